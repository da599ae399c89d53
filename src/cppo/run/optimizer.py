"""The optimizer and its learning-rate schedule, from the config's optimisation section."""

from __future__ import annotations

import inspect
import warnings
from typing import TYPE_CHECKING

import torch

from cppo.errors import ConfigError

if TYPE_CHECKING:
    from cppo.config.sections import OptimizationSection

# optim_args keys: torch AdamW's switches, and the numbers the fields set (beta1/beta2 as
# transformers names them); values are parsed as their type
OPTIM_ARGS = {"amsgrad": bool, "maximize": bool, "foreach": bool, "capturable": bool,
              "differentiable": bool, "fused": bool, "lr": float, "eps": float,
              "weight_decay": float, "beta1": float, "beta2": float}
_SCHEDULE_OWN = {"optimizer", "num_warmup_steps", "num_training_steps", "last_epoch"}


def parse_optim_args(text: str | None) -> dict:
    """TRL's optim_args 'key=value,key2=value2' -> AdamW keyword arguments (beta1/beta2 ->
    betas is left to the caller); ConfigError naming the field for a malformed pair, an
    unknown key or a value of the wrong type."""
    out = {}
    for pair in (text or "").replace(" ", "").split(","):
        if not pair:
            continue
        key, sep, value = pair.partition("=")
        if not sep or not key or not value:
            raise ConfigError(f"'optim_args' is {text!r}; {pair!r} is not key=value: write "
                              f"'key=value,key2=value2' (e.g. 'amsgrad=true,eps=1e-6')")
        if key not in OPTIM_ARGS:
            raise ConfigError(f"'optim_args' has {key!r}, which cppo's AdamW does not take; "
                              f"allowed: {', '.join(OPTIM_ARGS)}")
        out[key] = _typed(key, value, OPTIM_ARGS[key], text)
    return out


def _typed(key: str, value: str, kind: type, text: str):
    if kind is bool:
        if value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
    else:
        try:
            return float(value)
        except ValueError:
            pass
    raise ConfigError(f"'optim_args' is {text!r}; {key}={value!r} is not a {kind.__name__}")


def adamw_kwargs(optimization: OptimizationSection) -> dict:
    """torch AdamW's keyword arguments: the optimisation section's fields, with optim_args over
    them."""
    extra = parse_optim_args(optimization.optim_args)
    betas = (extra.pop("beta1", optimization.adam_beta1),
             extra.pop("beta2", optimization.adam_beta2))
    return {"lr": optimization.learning_rate, "betas": betas, "eps": optimization.adam_epsilon,
            "weight_decay": optimization.weight_decay, **extra}


def schedule_arguments(name: str) -> set[str]:
    """The extra keyword arguments transformers' schedule `name` takes (lr_scheduler_kwargs)."""
    from transformers.optimization import TYPE_TO_SCHEDULER_FUNCTION
    from transformers.trainer_utils import SchedulerType
    function = TYPE_TO_SCHEDULER_FUNCTION[SchedulerType(name)]
    return set(inspect.signature(function).parameters) - _SCHEDULE_OWN


def check_schedule_kwargs(name: str, kwargs: dict | None) -> None:
    """ConfigError naming lr_scheduler_kwargs when a key is one schedule `name` does not take."""
    unknown = sorted(set(kwargs or {}) - schedule_arguments(name))
    if unknown:
        takes = ", ".join(sorted(schedule_arguments(name))) or "none"
        raise ConfigError(f"'lr_scheduler_kwargs' has {', '.join(map(repr, unknown))}, which "
                          f"lr_scheduler_type {name!r} does not take (it takes: {takes}): "
                          f"remove it or pick the schedule that takes it")
    from transformers import get_scheduler
    trial = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    try:   # a value the schedule refuses (e.g. cosine_with_min_lr without min_lr), before training
        get_scheduler(name, trial, num_warmup_steps=1, num_training_steps=10,
                      scheduler_specific_kwargs=dict(kwargs or {}))
    except (TypeError, ValueError) as err:
        raise ConfigError(f"'lr_scheduler_kwargs' is {kwargs!r} for lr_scheduler_type {name!r}, "
                          f"which refuses it: {err}") from None


def make_adamw(parameters: list, optimization: OptimizationSection) -> torch.optim.AdamW:
    """AdamW with the fused kernel where torch has one for these tensors (CPU and CUDA floats:
    one kernel instead of a dozen ops per tensor), else the default implementation; optim_args
    over the optimisation section's fields (an explicit fused/foreach there wins)."""
    kwargs = adamw_kwargs(optimization)
    if "fused" in kwargs or "foreach" in kwargs or kwargs.get("differentiable"):
        return torch.optim.AdamW(parameters, **kwargs)
    fusable = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in parameters)
    if fusable:
        try:
            return torch.optim.AdamW(parameters, fused=True, **kwargs)
        except (RuntimeError, ValueError):
            pass
    return torch.optim.AdamW(parameters, **kwargs)


def make_scheduler(optimizer: torch.optim.Optimizer, optimization: OptimizationSection,
                   total_steps: int):
    """transformers' schedule lr_scheduler_type over total_steps, warmup_ratio of them warming up,
    with lr_scheduler_kwargs (the optimisation section's fields)."""
    from transformers import get_scheduler
    return get_scheduler(optimization.lr_scheduler_type, optimizer,
                         num_warmup_steps=int(optimization.warmup_ratio * total_steps),
                         num_training_steps=total_steps,
                         scheduler_specific_kwargs=dict(optimization.lr_scheduler_kwargs or {}))


def advance_schedule(scheduler, steps: int) -> None:
    """Move the LR schedule on for steps that made no update (skipped or non-finite)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(steps):
            scheduler.step()
