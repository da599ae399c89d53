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
from typing import TYPE_CHECKING

import torch
from cppo.errors import ConfigError, SlowPrecisionWarning

if TYPE_CHECKING:
    from cppo.config.sections import PrecisionSection, SamplingSection

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


def cuda_tf32_available() -> bool:
    """transformers' is_torch_tf32_available: a CUDA GPU of compute capability 8.0 or newer."""
    return (torch.cuda.is_available() and torch.version.cuda is not None
            and torch.cuda.get_device_properties(torch.cuda.current_device()).major >= 8)


def tf32_setting(tf32: bool | None, *, torch_compile: bool, fp16: bool, bf16: bool,
                 available: bool) -> bool | None:
    """What TF32 is set to (None: left as it is), transformers' rule: tf32 when given; with
    torch_compile and tf32 None, on unless fp16 (bf16 turns it on regardless); never where the
    device has no TF32 (a true tf32 there is refused by the config's checks)."""
    if not available:
        return None
    if tf32 is not None:
        return tf32
    return True if torch_compile and (not fp16 or bf16) else None


def apply_tf32(precision: PrecisionSection, bf16: bool) -> bool | None:
    """Set TF32 for CUDA matmuls and cuDNN as `tf32_setting` says for the run's `precision` and
    bf16; returns what it set."""
    setting = tf32_setting(precision.tf32, torch_compile=compiling(precision), fp16=precision.fp16,
                           bf16=bf16, available=cuda_tf32_available())
    if setting is not None and hasattr(torch.backends, "fp32_precision"):   # torch >= 2.9
        torch.backends.fp32_precision = "tf32" if setting else "ieee"   # as transformers sets it
    elif setting is not None:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = setting
    return setting


def compiling(precision: PrecisionSection) -> bool:
    """transformers' rule: torch_compile, or a torch_compile_backend or torch_compile_mode given."""
    from cppo.models.compiled import compile_settings
    return compile_settings(precision) is not None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def slow_precision_requests(device: torch.device | str, *, bf16: bool = False, fp16: bool = False,
                            torch_dtype: str | None = None, generation_dtype: str | None = None,
                            matmul_dtype: str | None = None) -> list[str]:
    """The config fields given (by their names) that ask for a dtype `device` computes slowly,
    each with its value."""
    asked = []
    if bf16:
        asked.append(("bf16", "true", "bfloat16"))
    if fp16:
        asked.append(("fp16", "true", "float16"))
    for key, value in (("torch_dtype", torch_dtype), ("generation_dtype", generation_dtype),
                       ("matmul_dtype", matmul_dtype)):
        if value in LOW_PRECISION:
            asked.append((key, value, value))
    return [f"{key}={value}" for key, value, dtype in asked if not has_fast_dtype(dtype, device)]


def warn_slow_precision(device: torch.device | str, *, bf16: bool = False, fp16: bool = False,
                        torch_dtype: str | None = None, generation_dtype: str | None = None,
                        matmul_dtype: str | None = None) -> None:
    """Warn (SlowPrecisionWarning) when the config fields given ask for bf16/fp16 on a device
    without native support for it, saying what it costs and what to use instead."""
    slow = slow_precision_requests(device, bf16=bf16, fp16=fp16, torch_dtype=torch_dtype,
                                   generation_dtype=generation_dtype, matmul_dtype=matmul_dtype)
    if not slow:
        return
    where = "this GPU" if torch.device(device).type == "cuda" else (
        f"this CPU (torch's CPU capability: {cpu_capability()}, no native bf16/fp16 dot products)")
    warnings.warn(f"{', '.join(slow)} asked for on {where}: these dtypes are emulated here, "
                  f"several times slower than float32 for the forward and tens of times slower for "
                  f"the backward. Use float32 (the default: drop {', '.join(s.split('=')[0] for s in slow)}) "
                  f"on this machine; bf16 pays on CPUs with AVX512-BF16 or AMX and on recent GPUs "
                  f"(docs/performance.md).", SlowPrecisionWarning, stacklevel=2)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def resolve_generation_dtype(sampling: SamplingSection, policy_dtype: torch.dtype, device, *,
                             use_vllm: bool, built_in: bool, lean: tuple | None,
                             decode_multiply_adds: float, announce: bool) -> str | None:
    """The generation_dtype a run samples in (`sampling` is left as it is; use_vllm: vLLM samples):
    'auto' becomes bfloat16 or None (auto_generation_dtype; said in one line when `announce` and it
    is bfloat16, or when the batch alone kept float32). An explicit one and num_speculative_tokens
    need the lean forward on this model. lean: lean_forward_for's (forward, reason), None when not
    probed (generation_dtype_needs_lean says when to probe); built_in: cppo's sampler on the lean
    forward samples the round."""
    wants = lean_forward_wants(sampling, use_vllm)
    forward, reason = lean or (None, None)
    resolved = sampling.generation_dtype
    if resolved == "auto":
        copy = built_in and forward is not None
        work = decode_multiply_adds if copy else 0
        resolved = auto_generation_dtype(policy_dtype, device, copy, work)
        if resolved and announce:
            print(f"generation_dtype: auto -> {resolved}: sampling from a {resolved} copy of the "
                  f"policy, which this device computes fast (importance-sampling corrected; "
                  f"--generation_dtype none samples in {_dtype_name(policy_dtype)})", flush=True)
        elif copy and auto_generation_dtype(policy_dtype, device, copy) and announce:
            print(f"generation_dtype: auto -> {_dtype_name(policy_dtype)}: a decode step here "
                  f"({work:.1e} multiply-adds) is too small for bfloat16 to pay on this CPU (from "
                  f"{BF16_MIN_DECODE_MULTIPLY_ADDS:.0e}); --generation_dtype bfloat16 samples from "
                  f"the copy anyway", flush=True)
    if wants and forward is None:
        raise ConfigError(f"{' and '.join(wants)}, which needs the lean forward, but it does "
                          f"not support this model: {reason}")
    return resolved


def lean_forward_wants(sampling: SamplingSection, use_vllm: bool) -> list[str]:
    """The generation settings that need the lean forward on the model, as the config says them
    (use_vllm: vLLM samples)."""
    wants = [f"'generation_dtype' is {sampling.generation_dtype!r}"] \
        if sampling.generation_dtype and sampling.generation_dtype != "auto" else []
    if sampling.num_speculative_tokens and not use_vllm:
        wants.append(f"'num_speculative_tokens' is {sampling.num_speculative_tokens}")
    return wants


def resolve_matmul_dtype(matmul_dtype: str | None, policy_dtype: torch.dtype, device, *,
                         autocast: bool, lean: tuple | None, micro_batch_multiply_adds: float,
                         announce: bool) -> str | None:
    """The matmul_dtype the training passes run in (the config's value, left as it is): 'auto'
    becomes bfloat16 or None (auto_matmul_dtype; None when the passes autocast, bf16 or fp16;
    said in one line when `announce` and it is bfloat16); an explicit one needs the lean forward
    to run this model's training passes. lean: lean_forward_for's (forward, reason) (None only
    when matmul_dtype is None)."""
    if matmul_dtype is None:
        return None
    forward, reason = lean
    if matmul_dtype != "auto":
        if forward is None:
            raise ConfigError(f"'matmul_dtype' is {matmul_dtype!r}, which needs the lean "
                              f"forward, but it does not run this model's training passes: {reason}")
        return matmul_dtype
    resolved = None if autocast else auto_matmul_dtype(
        policy_dtype, device, forward is not None, micro_batch_multiply_adds)
    if resolved and announce:
        print(f"matmul_dtype: auto -> {resolved}: the training passes' Linear matmuls run in "
              f"{resolved}, which this device computes fast (weights, optimizer, attention, head "
              f"and loss stay {_dtype_name(policy_dtype)}; --matmul_dtype none keeps every matmul "
              f"in it)", flush=True)
    return resolved


def _multiply_adds_per_token(policy) -> int:
    from cppo.parallel.memory import ModelShape
    return ModelShape.from_config(policy.config).multiply_adds_per_token()


def run_generation_dtype(sampling: SamplingSection, policy, device, *, engine, use_vllm: bool,
                         built_in: bool, questions_per_step: int, announce: bool) -> str | None:
    """generation_dtype as a run uses it, 'auto' resolved from the device and one decode step's
    work (the completions decoded together); built_in: cppo's sampler on the lean forward samples
    the rounds; use_vllm: vLLM samples; the probe of the lean forward for sampling runs on the
    engine's gathered weights. Resolved before run_matmul_dtype (whose line it says first)."""
    from cppo.models.lean import lean_forward_for
    dtype = next(policy.parameters()).dtype
    probe = None
    if lean_forward_wants(sampling, use_vllm) or (sampling.generation_dtype == "auto" and built_in):
        with engine.gathered():   # the sampler runs on the gathered weights
            probe = lean_forward_for(policy)
    per_token = _multiply_adds_per_token(policy)
    decoded = questions_per_step * sampling.num_generations
    if sampling.generation_chunk_size:
        decoded = min(decoded, sampling.generation_chunk_size)
    return resolve_generation_dtype(sampling, dtype, device, use_vllm=use_vllm, built_in=built_in,
                                    lean=probe, decode_multiply_adds=decoded * per_token,
                                    announce=announce)


def run_matmul_dtype(sampling: SamplingSection, policy, device, *, lean_forward: bool,
                     autocast: bool, per_device_train_batch_size: int, announce: bool
                     ) -> str | None:
    """matmul_dtype as a run uses it, 'auto' resolved from the device and one micro-batch's
    linear-layer work (per_device_train_batch_size x max_completion_length tokens); lean_forward:
    the config's; autocast: bf16 or fp16."""
    from cppo.models.lean import lean_forward_for
    dtype = next(policy.parameters()).dtype
    per_token = _multiply_adds_per_token(policy)
    lean = None
    if sampling.matmul_dtype is not None:
        lean = lean_forward_for(policy) if lean_forward else (None, "lean_forward is false")
    work = per_device_train_batch_size * sampling.max_completion_length * per_token
    return resolve_matmul_dtype(sampling.matmul_dtype, dtype, device, autocast=autocast, lean=lean,
                                announce=announce, micro_batch_multiply_adds=work)
