#!/usr/bin/env bash
# Fill gpu_wheels/ (git-ignored) with the wheels benchmarks/gpu_check.sh installs on the GPU
# machine, which is offline: `pip install --no-index --find-links gpu_wheels ...` there.
#
#   bash scripts/gpu_wheels.sh            # from the repository root, here (where pip reaches PyPI)
#
# What the GPU image lacks, and only that. Its image (/work/.library/device/KINDS.md, package list
# read 2026-11-17; Python 3.12.3) holds torch 2.11, transformers 5.17, accelerate, peft, pytest,
# pytest-xdist, pytest-timeout, hypothesis, and also pandas, pyarrow, matplotlib (+ its deps),
# xxhash, fsspec, huggingface-hub, safetensors, tokenizers, pyyaml, tqdm, sympy, jinja2, psutil.
# Against cppo's dependencies (pyproject.toml) + TRL (benchmarks/real_shape.py, cppo_table.py)
# it lacks:
#   datasets       (cppo; TRL)           -> dill, multiprocess (its other needs are on the image)
#   math-verify    (cppo)                -> latex2sympy2_extended -> antlr4-python3-runtime
#   trl            (the benchmarks' TRL side; pure Python, ~0.9 MB)
#   bitsandbytes   (QLoRA: load_in_4bit / load_in_8bit; tests/test_cuda.py's QLoRA case; one
#                   py3-none wheel for every Python, ~43 MB, its CUDA kernels inside)
# plus pytest-timeout (pyproject's `timeout = 900`; the image has it, this is a tiny safety copy)
# and setuptools + wheel (0.45.1: the last with no dependency of its own; pyproject's build requires: `pip install -e .` builds cppo in an isolated
# environment, which offline finds them only here). Every one is pure Python (py3-none-any),
# except bitsandbytes (one py3-none-manylinux wheel with its native kernels) and multiprocess,
# which ships one wheel per Python minor: both 3.12 (the image) and 3.11 (this machine, for the
# offline proof) are fetched. pyarrow (~45 MB), pandas and matplotlib are deliberately NOT
# fetched: the image has them, and they would outgrow the 64 MiB that travels
# (benchmarks/results/gpu_check/offline_install.md measures the choice). With bitsandbytes the
# folder is ~45 MB, which with the ~7 MB working tree still fits.
#
# Versions are the ones this project's venv runs its tests with. Never torch, nvidia-* or triton:
# the script refuses to finish if one lands in the folder.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${GPU_WHEELS:-gpu_wheels}
PYTHONS=${GPU_WHEELS_PYTHONS:-"3.12 3.11"}
PKGS=(
    datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
    math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2
    trl==1.16.0
    bitsandbytes==0.50.2
    pytest-timeout==2.4.0
    setuptools==78.1.1 wheel==0.45.1
)
mkdir -p "$DEST"
rm -f "$DEST"/*.whl   # one version of each: a stale one beside a new one makes pip's choice ambiguous
for py in $PYTHONS; do
    python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
        --implementation cp --python-version "$py" --abi "cp${py/./}" --abi none \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform any \
        -d "$DEST" "${PKGS[@]}" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
done
if ls "$DEST" | grep -iE '^(torch|nvidia|triton|vllm)[-_]'; then
    echo "gpu_wheels.sh: a torch/nvidia/triton/vllm wheel landed in $DEST: remove it" >&2
    exit 1
fi
ls -l "$DEST"
du -sh "$DEST"
