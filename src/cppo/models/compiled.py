"""torch.compile on the training passes (transformers' torch_compile, torch_compile_backend,
torch_compile_mode): the settings, the compiled functions, and the time spent compiling.

What is compiled: the lean forward's per-token work of each decoder layer (norms, projections,
RoPE, MLP: `LeanForward.compile_layers`), or, for a model the lean forward does not run, the
model's own forward (`compiled_model`). Shapes change from one micro-batch to the next (packed
tokens), so functions are compiled with dynamic shapes. Sampling is not compiled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from cppo.config.sections import PrecisionSection


@dataclass(frozen=True)
class CompileSettings:
    """torch.compile's backend and mode (None: torch's default mode)."""

    backend: str = "inductor"
    mode: str | None = None


def compile_settings(precision: PrecisionSection) -> CompileSettings | None:
    """The compile settings of the run's `precision`, or None: off. transformers' rule:
    torch_compile, or a backend or mode given, turns it on; the backend defaults to inductor."""
    if not (precision.torch_compile or precision.torch_compile_backend or
            precision.torch_compile_mode):
        return None
    return CompileSettings(precision.torch_compile_backend or "inductor",
                           precision.torch_compile_mode)


def compile_fn(fn, settings: CompileSettings):
    """`fn` through torch.compile with dynamic shapes."""
    return torch.compile(fn, backend=settings.backend, mode=settings.mode, dynamic=True)


def compiled_model(model, settings: CompileSettings):
    """The model's forward compiled (one compiled wrapper per model and settings; it shares the
    model's parameters, so optimizer, checkpoints and engines see the model itself)."""
    cached = model.__dict__.get("_cppo_compiled")
    if cached is None or cached[0] != settings:
        # in the instance's __dict__, not as a submodule: state_dict and checkpoints never see it
        # (a weak-keyed table would keep the model alive: the wrapper refers to it)
        cached = model.__dict__["_cppo_compiled"] = (settings, compile_fn(model, settings))
    return cached[1]


def compile_seconds() -> float:
    """Seconds this process has spent in torch.compile so far (dynamo's own count: tracing,
    the backend's forward and backward graphs)."""
    from torch._dynamo.utils import compilation_time_metrics
    return float(sum(compilation_time_metrics.get("_compile.compile_inner", ())))
