"""What the metrics of a round count (a completion's model tokens) and when a round crosses a
cadence (logging, evaluation, saving every so many steps). The round's own metrics:
cppo.assembly.rounds."""

from __future__ import annotations

import torch


def model_token_lengths(completions) -> torch.Tensor:
    """(N,) float: each completion's tokens, a tool's left out (TRL: the model's tokens)."""
    if completions.tool_mask is None:
        return completions.lengths.float()
    return (completions.mask * completions.tool_mask).sum(-1).float()


def crossed(step: int, every: int, num_iterations: int) -> bool:
    """True when the round that ended at optimizer step `step` (num_iterations steps a round)
    crossed a multiple of `every` steps."""
    before = (step - 1) // num_iterations * num_iterations   # the round's start
    return step // every > before // every


def push_metrics(seconds: float, pushed_bytes: int) -> dict:
    """A weight push's metrics: its seconds on the trainer's side (TRL's perf/weight_sync_s) and
    the bytes of the tensors it sent (cppo/weight_sync_bytes: the whole model, LoRA merged, or
    the adapter alone with vllm_push: adapter)."""
    return {"perf/weight_sync_s": seconds, "cppo/weight_sync_bytes": float(pushed_bytes)}
