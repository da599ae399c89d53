#!/usr/bin/env bash
# The GPU check: on one CUDA GPU, in about 10-14 minutes,
#   1. the tests marked `cuda` (they skip on a CPU-only machine), vLLM's CUDA build included
#      (tests/test_vllm_cuda.py: colocate with sleep mode; the server's NCCL weight push, which
#      needs a second GPU and skips on one),
#   2. the real-shape benchmark in bfloat16 (cppo against TRL's GRPOTrainer),
#   3. the paper table on the embedded model (quick mode),
# writing everything under benchmarks/results/gpu/.
#
#   bash benchmarks/gpu_check.sh            # from the repository root, in the project's venv
#                                           # with `pip install -e ".[test,bench,vllm]"`
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=benchmarks/results/gpu
mkdir -p "$OUT"

python - <<'PY' | tee "$OUT/machine.json"
import json, torch
from cppo.parallel import hardware
if not torch.cuda.is_available():
    raise SystemExit("gpu_check.sh needs a CUDA GPU: torch.cuda.is_available() is False")
print(json.dumps(hardware.describe("cuda"), indent=2))
PY

start=$(date +%s)
echo "== 1/3 tests marked cuda"
timeout 360 python -m pytest -m cuda -p no:cacheprovider -q -rs tests 2>&1 | tee "$OUT/tests.txt"

echo "== 2/3 real-shape benchmark, bf16"
timeout 300 python benchmarks/real_shape.py --device cuda --dtype bfloat16 --quick \
    --output "$OUT/real_shape" 2>&1 | tee "$OUT/real_shape.log"

echo "== 3/3 paper table on the embedded model (quick)"
timeout 180 python benchmarks/cppo_table.py --quick --output "$OUT/cppo_table" 2>&1 \
    | tee "$OUT/cppo_table.log"

echo "gpu_check.sh finished in $(( $(date +%s) - start )) s; results in $OUT/" | tee "$OUT/done.txt"
