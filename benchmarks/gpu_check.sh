#!/usr/bin/env bash
# The GPU check: on one CUDA GPU, in under 10 minutes,
#   0. cppo installed on the machine's own torch and transformers, offline, from gpu_wheels/
#      (what the GPU image lacks: datasets, math-verify, TRL, ...; scripts/gpu_wheels.sh),
#   1. the tests marked `cuda` (they skip on a CPU-only machine), QLoRA on bitsandbytes' CUDA
#      kernels, async_rollout's generator process on the GPU (its weights through CUDA IPC) and
#      its vLLM server generator's NCCL push from a GPU snapshot (TRL's client faked, no server)
#      (tests/test_cuda.py; bitsandbytes, TRL from gpu_wheels/), vLLM's CUDA build included where
#      it is installed (tests/test_vllm_cuda.py: colocate with sleep mode; the server's NCCL weight
#      push, which needs a second GPU); where vLLM is absent (the GPU image has none) they skip,
#   2. the real-shape benchmark in bfloat16 (cppo against TRL's GRPOTrainer; cppo alone without TRL),
#   3. the torch_compile benchmark on the embedded model (quick mode, inductor on CUDA),
#   4. the paper table on the embedded model (quick mode),
# writing everything under benchmarks/results/gpu/ and, where the variable OUT names a folder (the
# device tool's), packing it there: gpu_check.tar.gz, summary.txt, tests.log.
#
# On the lent GPU machine (the device tool's `run`; bare and offline, Python 3.12 with torch 2.11,
# transformers 5.17, no vLLM/TRL/datasets/math-verify). Here, once, from the repository root:
#
#   bash scripts/gpu_wheels.sh           # fills gpu_wheels/ (git-ignored, ~45 MB, 43 of them bitsandbytes)
#
# then the one device call (9 min 50 s at most; the script stops itself by 560 s):
#
#   run(command="bash benchmarks/gpu_check.sh", carry=["gpu_wheels"], timeout_s=590)
#
# and `tar xzf <files_at>/gpu_check.tar.gz` here to get benchmarks/results/gpu/. With the machine's
# start (a minute or more) that one call is most of a session's 15 minutes of device time, with no
# room for a second; a shorter one: command "GPU_CHECK_BUDGET=300 bash benchmarks/gpu_check.sh",
# timeout_s=330 (the later steps are cut or skipped, summary.txt says which).
#
# Elsewhere (a GPU machine with the project's venv and `pip install -e ".[test,bench,vllm]"`):
#   bash benchmarks/gpu_check.sh        # no gpu_wheels/ folder: installs nothing, runs 1-4
#
#   bash benchmarks/gpu_check.sh --install-only   # step 0 and the import check only (no GPU needed)
#   GPU_CHECK_BUDGET=560 (seconds for the whole script), PYTHON=python3, GPU_WHEELS=gpu_wheels,
#   GPU_CHECK_RESULTS=benchmarks/results/gpu
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=${GPU_WHEELS:-gpu_wheels}
BUDGET=${GPU_CHECK_BUDGET:-560}
RES=${GPU_CHECK_RESULTS:-benchmarks/results/gpu}
INSTALL_ONLY=0
[ "${1:-}" = "--install-only" ] && INSTALL_ONLY=1
mkdir -p "$RES"
: > "$RES/summary.txt"
failed=""
start=$(date +%s)
export PYTHONUNBUFFERED=1
# offline: nothing asks the Hub (every model here is a local folder), no retries against a network
# that is not there; plots headless
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 MPLBACKEND=Agg

pack() {   # the device tool brings back at most 8 files, 2 folders down: one archive + 2 to read
    local rc=$?
    echo "failed steps:${failed:- none}" | tee -a "$RES/summary.txt"
    echo "gpu_check.sh finished in $(( $(date +%s) - start )) s; results in $RES/" | tee -a "$RES/summary.txt"
    if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
        tar czf "$OUT/gpu_check.tar.gz" "$RES"
        cp "$RES/summary.txt" "$OUT/"
        [ -f "$RES/tests.log" ] && cp "$RES/tests.log" "$OUT/"
    fi
    if [ -n "$failed" ] && (( rc == 0 )); then exit 1; fi
}
trap pack EXIT

# step NAME LIMIT CMD...: runs CMD under min(LIMIT, what is left of the budget), its output in
# $RES/NAME.log, and goes on whatever its exit status (summary.txt records it)
step() {
    local name=$1 limit=$2 t0 left rc
    shift 2
    t0=$(date +%s)
    left=$(( BUDGET - (t0 - start) - 10 ))
    (( left < limit )) && limit=$left
    if (( limit < 20 )); then
        echo "$name: skipped (budget of $BUDGET s spent)" | tee -a "$RES/summary.txt"
        return 0
    fi
    echo "== $name (at most $limit s)"
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$RES/$name.log"
    rc=${PIPESTATUS[0]}
    (( rc == 0 )) || failed+=" $name"
    echo "$name: exit $rc in $(( $(date +%s) - t0 )) s$( ((rc == 124 || rc == 137)) && echo " (timed out at $limit s)")" \
        | tee -a "$RES/summary.txt"
    return 0
}

# ---- 0. install, offline, from gpu_wheels/ (only where that folder is) -----------------------
install() {
    export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore PIP_NO_INPUT=1
    local pip=("$PY" -m pip install -q --no-index --find-links "$WHEELS")
    # what the image lacks, resolved against what it has (upgrades nothing that is there) ...
    if ! "${pip[@]}" datasets math-verify trl pytest-timeout bitsandbytes; then
        # ... or, where a pin of the image's own packages clashes (datasets caps fsspec, say),
        # the same wheels without their dependency checks
        echo "gpu_check.sh: resolving against the image failed; installing the wheels with --no-deps"
        "${pip[@]}" --no-deps datasets dill multiprocess math-verify latex2sympy2_extended \
            antlr4-python3-runtime trl pytest-timeout bitsandbytes || return 1
    fi
    # cppo itself on the image's torch and transformers (its build needs setuptools + wheel: in
    # gpu_wheels/, for pip's isolated build environment)
    "${pip[@]}" --no-deps -e . || return 1
}
if [ -d "$WHEELS" ]; then
    export -f install
    export PY WHEELS
    step install 120 bash -c install
elif ! "$PY" -c "import cppo" 2>/dev/null; then
    echo "gpu_check.sh: cppo is not importable and there is no $WHEELS/ folder: run" \
         "scripts/gpu_wheels.sh here and carry $WHEELS (see the top of this file)" | tee -a "$RES/summary.txt"
    exit 1
fi
step imports 60 "$PY" - <<'PY'
import importlib, importlib.metadata as md
need = ["cppo", "torch", "transformers", "accelerate", "datasets", "math_verify", "safetensors",
        "tokenizers", "yaml", "tqdm", "matplotlib", "pandas", "pyarrow", "pytest", "xdist",
        "hypothesis", "pytest_timeout"]
optional = ["trl", "vllm", "peft", "bitsandbytes"]
missing = []
for name in need + optional:
    try:
        module = importlib.import_module(name)
        dist = {"yaml": "pyyaml", "xdist": "pytest-xdist", "math_verify": "math-verify",
                "pytest_timeout": "pytest-timeout"}.get(name, name)
        try:
            version = md.version(dist)
        except md.PackageNotFoundError:
            version = getattr(module, "__version__", "")
        print(f"{name:15s} {version}")
    except Exception as e:  # noqa: BLE001 - the line says what failed
        print(f"{name:15s} MISSING ({type(e).__name__}: {str(e)[:100]})")
        if name in need:
            missing.append(name)
if "cppo" not in missing:
    import cppo, pathlib
    print("cppo from", pathlib.Path(cppo.__file__).parent)
raise SystemExit(f"missing: {', '.join(missing)}" if missing else 0)
PY
if (( INSTALL_ONLY )); then
    exit 0
fi

# ---- the GPU ---------------------------------------------------------------------------------
"$PY" - <<'PY' 2>&1 | tee "$RES/machine.json"
import json, torch
from cppo.parallel import hardware
if not torch.cuda.is_available():
    raise SystemExit("gpu_check.sh needs a CUDA GPU: torch.cuda.is_available() is False")
print(json.dumps(hardware.describe("cuda"), indent=2))
PY
gpu=${PIPESTATUS[0]}
if (( gpu != 0 )); then
    echo "no CUDA GPU: steps 1-4 not run" | tee -a "$RES/summary.txt"
    exit 1
fi

# 1. every test module is collected (a module that cannot import on the image is an error line,
#    not a lost step); only the `cuda` ones run; -rs prints each skip's reason (vLLM absent, ...)
step tests 200 "$PY" -m pytest -m cuda -p no:cacheprovider -rs --continue-on-collection-errors \
    -o timeout=150 tests

# 2. TRL's side only where TRL imports (gpu_wheels/ ships it)
systems=()
"$PY" -c "import trl" 2>/dev/null || systems=(--systems cppo_grpo cppo_cppo)
step real_shape 180 "$PY" benchmarks/real_shape.py --device cuda --dtype bfloat16 --quick \
    "${systems[@]}" --output "$RES/real_shape"

# 3. torch_compile on the training passes (inductor, CUDA): compile seconds and the speed-up
step torch_compile 90 "$PY" benchmarks/torch_compile.py --quick --device cuda --threads 4 \
    --output "$RES/torch_compile"

# 4.
step cppo_table 150 "$PY" benchmarks/cppo_table.py --quick --output "$RES/cppo_table"
