"""Importance sampling against the sampler: the tokens came from an engine (vLLM, a cast copy of the
policy) whose distribution differs slightly from the policy that scores them; each token's (or each
sequence's) loss is weighted by pi_policy / pi_sampler, truncated or masked outside
[clip_min, clip_max]. TRL 1.16's `vllm_importance_sampling_mode`:

* token_truncate:    rho_t = clamp(exp(policy_t - sampler_t), clip_min, clip_max), (N, T)
* token_mask:        rho_t = exp(policy_t - sampler_t), 0 where outside [clip_min, clip_max]
* sequence_truncate: rho = clamp(exp(sum_t mask_t (policy_t - sampler_t)), ...), (N, 1)
* sequence_mask:     rho = exp(sum_t ...), 0 where outside the bounds (the whole sequence)

A bound of None is no bound. A NaN sampler log-prob (a token the engine could not score) gives a
zero difference (rho = 1) as in TRL.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def is_sequence_mode(mode: str) -> bool:
    if mode not in IMPORTANCE_SAMPLING_MODES:
        raise ValueError(f"importance sampling mode must be one of {IMPORTANCE_SAMPLING_MODES}, "
                         f"got {mode!r}")
    return mode.startswith("sequence")


def sampler_importance_weights(policy_logps: Tensor, sampler_logps: Tensor, completion_mask: Tensor,
                               mode: str = "token_truncate", clip_min: float | None = None,
                               clip_max: float | None = 3.0) -> Tensor:
    """Importance weights of the sampled tokens, detached: (N, T) in token modes, (N, 1) in
    sequence modes. policy_logps, sampler_logps, completion_mask: (N, T) (the policy's log-probs
    at sampling time -- the old policy -- and the sampler's own)."""
    sequence = is_sequence_mode(mode)
    if policy_logps.shape != sampler_logps.shape or policy_logps.shape != completion_mask.shape:
        raise ValueError(f"policy_logps {tuple(policy_logps.shape)}, sampler_logps "
                         f"{tuple(sampler_logps.shape)} and completion_mask "
                         f"{tuple(completion_mask.shape)} must have the same shape")
    if mode.endswith("truncate") and clip_min is None and clip_max is None:
        raise ValueError(f"mode {mode!r} truncates: set clip_min or clip_max")
    diff = (policy_logps.detach().float() - sampler_logps.detach().float()) * completion_mask.float()
    diff = torch.nan_to_num(diff, nan=0.0)
    if sequence:
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


# decorators written as calls: mutmut does not mutate a decorated function
sampler_importance_weights = torch.no_grad()(sampler_importance_weights)


def sampler_correction_stats(policy_logps: Tensor, sampler_logps: Tensor, completion_mask: Tensor,
                             weights: Tensor) -> dict[str, Tensor]:
    """What TRL logs of the correction, as (sum, count, min, max) pieces one can reduce over
    micro-batches and processes: the weights over the masked tokens (token modes) or the
    sequences (sequence modes, weights (N, 1)), and |policy - sampler| over the masked tokens
    whose sampler log-prob is not NaN. Empty selections give min +inf and max -inf."""
    mask = completion_mask.bool()
    ratio = weights.flatten() if weights.shape[-1] == 1 and mask.shape[-1] != 1 else weights[mask]
    delta = (policy_logps.detach().float() - sampler_logps.detach().float()).abs()
    delta = delta[mask & ~torch.isnan(delta)]

    def pieces(values: Tensor, name: str) -> dict[str, Tensor]:
        values = values.float()
        inf = torch.tensor(math.inf, device=values.device)
        return {f"{name}_sum": values.sum(), f"{name}_count": torch.tensor(float(values.numel())),
                f"{name}_min": values.min() if values.numel() else inf,
                f"{name}_max": values.max() if values.numel() else -inf}
    return {**pieces(ratio, "ratio"), **pieces(delta, "logp_diff")}


sampler_correction_stats = torch.no_grad()(sampler_correction_stats)
