"""What this machine computes fast, and a warning when a run asks for a precision it does not.

bfloat16 pays where the hardware has native bf16 dot products: CUDA GPUs of compute capability
8.0+ (and ROCm), and CPUs with AVX512-BF16 or AMX that oneDNN (torch's CPU matmul library) is
allowed to use (ONEDNN_MAX_CPU_ISA can forbid it). Elsewhere, for instance on an AVX2-only CPU, torch
converts bf16 to float32 and back around every operation: the forward of a bf16 Linear is several
times slower than float32 and its backward tens of times slower. float16 on a CPU is fast only with
AVX512-FP16 or AMX-FP16. See docs/performance.md.
"""

from __future__ import annotations

import math
import platform
import warnings
from functools import lru_cache

import torch
from cppo.errors import SlowPrecisionWarning

LOW_PRECISION = ("bfloat16", "float16")
# A CPU's bfloat16 matmul has a fixed cost per call (oneDNN's set-up and conversions) that float32
# does not: sampling from a bfloat16 copy pays only once a decode step has this much work
# (completions decoded together x the model's multiply-adds per token; docs/performance.md), and
# bfloat16 training matmuls once a micro-batch has it (its tokens x multiply-adds per token).
BF16_MIN_DECODE_MULTIPLY_ADDS = 4e8


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (Linux; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _probe(name: str, flags: tuple[str, ...]) -> bool:
    """torch's own CPU probe when this torch has it, else the /proc/cpuinfo flags."""
    probe = getattr(torch.cpu, name, None)
    if probe is not None:
        try:
            return bool(probe())
        except RuntimeError:
            pass
    return any(f in cpu_flags() for f in flags)


def cpu_capability() -> str:
    """The vector ISA torch's CPU kernels run with: 'AVX512', 'AVX2', 'DEFAULT', ..."""
    return torch.backends.cpu.get_cpu_capability()


def cpu_has_fast_dtype(dtype: str) -> bool:
    """True when this CPU (as torch uses it) has native dot products for `dtype`
    ('bfloat16' or 'float16'); float32 is always native."""
    if dtype not in LOW_PRECISION:
        return True
    if dtype == "bfloat16":
        hardware = _probe("_is_avx512_bf16_supported", ("avx512_bf16",)) or \
            _probe("_is_amx_tile_supported", ("amx_bf16",))
        onednn = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    else:
        hardware = _probe("_is_amx_fp16_supported", ("amx_fp16",)) or "avx512_fp16" in cpu_flags()
        onednn = getattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", None)
    try:   # oneDNN honours ONEDNN_MAX_CPU_ISA; a limit below the ISA makes matmuls slow again
        allowed = bool(onednn()) if onednn is not None else True
    except RuntimeError:
        allowed = True
    return hardware and allowed


def has_fast_dtype(dtype: str, device: torch.device | str = "cpu") -> bool:
    """True when `device` computes `dtype` at least about as fast as float32."""
    device = torch.device(device)
    if dtype not in LOW_PRECISION:
        return True
    if device.type == "cuda":
        return dtype == "float16" or torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type == "cpu":
        return cpu_has_fast_dtype(dtype)
    return True   # other accelerators: trust the user's choice


def auto_generation_dtype(policy_dtype: torch.dtype, device: torch.device | str,
                          samples_from_a_copy: bool, decode_multiply_adds: float = math.inf) -> str | None:
    """What generation_dtype 'auto' samples in: bfloat16 where `device` computes it fast and the
    policy is float32, when the sampler can sample from a copy of the weights (the built-in
    sampler on the lean forward) and, on a CPU, when one decode step is large enough
    (`decode_multiply_adds`: completions decoded together x multiply-adds per token, at least
    BF16_MIN_DECODE_MULTIPLY_ADDS); None, the policy's own dtype, otherwise."""
    if not samples_from_a_copy or policy_dtype != torch.float32:
        return None
    if not has_fast_dtype("bfloat16", device):
        return None
    if torch.device(device).type == "cpu" and decode_multiply_adds < BF16_MIN_DECODE_MULTIPLY_ADDS:
        return None
    return "bfloat16"


def auto_matmul_dtype(policy_dtype: torch.dtype, device: torch.device | str, lean: bool,
                      micro_batch_multiply_adds: float = math.inf) -> str | None:
    """What matmul_dtype 'auto' runs the training passes' Linear matmuls in: bfloat16 where
    `device` computes it fast, the policy is float32, the lean forward runs the passes (`lean`)
    and, on a CPU, a micro-batch's linear-layer work is at least BF16_MIN_DECODE_MULTIPLY_ADDS;
    None (the policy's own dtype) otherwise."""
    if not lean or policy_dtype != torch.float32 or not has_fast_dtype("bfloat16", device):
        return None
    if torch.device(device).type == "cpu" and micro_batch_multiply_adds < BF16_MIN_DECODE_MULTIPLY_ADDS:
        return None
    return "bfloat16"


def describe(device: torch.device | str = "cpu") -> dict:
    """A record of the compute a measurement ran on, for benchmark results."""
    flags = cpu_flags()
    info = {"cpu": _cpu_model(), "machine": platform.machine(), "torch": torch.__version__,
            "cpu_capability": cpu_capability(), "threads": torch.get_num_threads(),
            "avx512_bf16": "avx512_bf16" in flags, "amx_bf16": "amx_bf16" in flags,
            "fast_bfloat16": has_fast_dtype("bfloat16", "cpu")}
    device = torch.device(device)
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["fast_bfloat16"] = has_fast_dtype("bfloat16", device)
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def slow_precision_requests(args, device: torch.device | str) -> list[str]:
    """The config fields that ask for a dtype `device` computes slowly, each with its value."""
    asked = []
    if getattr(args, "bf16", False):
        asked.append(("bf16", "true", "bfloat16"))
    for key in ("torch_dtype", "generation_dtype", "matmul_dtype"):
        value = getattr(args, key, None)
        if value in LOW_PRECISION:
            asked.append((key, value, value))
    return [f"{key}={value}" for key, value, dtype in asked if not has_fast_dtype(dtype, device)]


def warn_slow_precision(args, device: torch.device | str) -> None:
    """Warn (SlowPrecisionWarning) when the config asks for bf16/fp16 on a device without native
    support for it, saying what it costs and what to use instead."""
    slow = slow_precision_requests(args, device)
    if not slow:
        return
    where = "this GPU" if torch.device(device).type == "cuda" else (
        f"this CPU (torch's CPU capability: {cpu_capability()}, no native bf16/fp16 dot products)")
    warnings.warn(f"{', '.join(slow)} asked for on {where}: these dtypes are emulated here, "
                  f"several times slower than float32 for the forward and tens of times slower for "
                  f"the backward. Use float32 (the default: drop {', '.join(s.split('=')[0] for s in slow)}) "
                  f"on this machine; bf16 pays on CPUs with AVX512-BF16 or AMX and on recent GPUs "
                  f"(docs/performance.md).", SlowPrecisionWarning, stacklevel=2)
