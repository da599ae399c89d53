"""The optimizer and its learning-rate schedule, from the config."""

from __future__ import annotations

import warnings

import torch


def make_adamw(parameters: list, args) -> torch.optim.AdamW:
    """AdamW with the fused kernel where torch has one for these tensors (CPU and CUDA floats:
    one kernel instead of a dozen ops per tensor), else the default implementation."""
    kwargs = dict(lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                  eps=args.adam_epsilon, weight_decay=args.weight_decay)
    fusable = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in parameters)
    if fusable:
        try:
            return torch.optim.AdamW(parameters, fused=True, **kwargs)
        except (RuntimeError, ValueError):
            pass
    return torch.optim.AdamW(parameters, **kwargs)


def make_scheduler(optimizer: torch.optim.Optimizer, args, total_steps: int):
    """transformers' schedule lr_scheduler_type over total_steps, warmup_ratio of them warming up."""
    from transformers import get_scheduler
    return get_scheduler(args.lr_scheduler_type, optimizer,
                         num_warmup_steps=int(args.warmup_ratio * total_steps),
                         num_training_steps=total_steps)


def advance_schedule(scheduler, steps: int) -> None:
    """Move the LR schedule on for steps that made no update (skipped or non-finite)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(steps):
            scheduler.step()
