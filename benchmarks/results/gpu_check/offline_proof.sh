#!/usr/bin/env bash
# offline proof of benchmarks/gpu_check.sh's install on an image-shaped venv
set -u
cd /work/main
V=/tmp/gpuimg/bin/python
$V -m pip uninstall -q -y cppo datasets dill multiprocess math-verify latex2sympy2_extended antlr4-python3-runtime trl pytest-timeout 2>/dev/null
echo "== image-shaped venv before install:"; $V -m pip list 2>/dev/null | awk 'NR>2{printf "%s %s, ", $1, $2}'; echo
unset PIP_FIND_LINKS; export PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1
rm -rf /tmp/proof
t0=$(date +%s)
echo "== 1. install (gpu_check.sh --install-only)"
PYTHON=$V GPU_CHECK_RESULTS=/tmp/proof bash benchmarks/gpu_check.sh --install-only; echo "rc=$? in $(( $(date +%s) - t0 )) s"
echo "== installed from gpu_wheels:"; $V -m pip list 2>/dev/null | grep -iE "^(cppo|datasets|dill|multiprocess|math-verify|latex2sympy2|antlr4|trl|pytest-timeout) "
t1=$(date +%s)
echo "== 2. every test module collected"
$V -m pytest --collect-only -q -p no:cacheprovider tests 2>&1 | tail -4; echo "rc=${PIPESTATUS[0]} in $(( $(date +%s) - t1 )) s"
t2=$(date +%s)
echo "== 3. gpu_check.sh's test step as it runs there (-m cuda: all skip here, no GPU)"
$V -m pytest -m cuda -p no:cacheprovider -rs --continue-on-collection-errors -o timeout=150 tests 2>&1 | tail -12; echo "rc=${PIPESTATUS[0]} in $(( $(date +%s) - t2 )) s"
t3=$(date +%s)
echo "== 4. the subset that needs neither vLLM nor a GPU"
$V -m pytest -p no:cacheprovider -rfEs \
  tests/test_algorithm_advantages.py tests/test_algorithm_allocation.py tests/test_algorithm_loss.py tests/test_algorithm_selection.py \
  tests/test_eca_scheme.py tests/test_eca_counting.py tests/test_eca_attention.py tests/test_eca_hf.py tests/test_eca_executor.py tests/test_eca_training.py \
  tests/test_config.py tests/test_rewards_math.py tests/test_rewards_answers.py tests/test_data_loaders.py tests/test_task.py \
  tests/test_prompt_encoding.py tests/test_sampling_logits.py tests/test_hardware.py tests/test_trainer.py tests/test_lean_forward.py \
  tests/test_models.py tests/test_trl_compat.py tests/test_trl_fields.py tests/test_trl_edges.py tests/test_trl_cli.py \
  tests/test_objectives_pruning.py tests/test_padding_free.py tests/test_rollout.py tests/test_skipping.py tests/test_trimming.py \
  tests/test_two_stage.py tests/test_layout.py tests/test_chunked_head.py tests/test_one_precision.py tests/test_memory.py \
  tests/test_sampler_correction.py tests/test_cuda.py tests/test_vllm_cuda.py 2>&1 | tail -25
echo "rc=${PIPESTATUS[0]} in $(( $(date +%s) - t3 )) s"
