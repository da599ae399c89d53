"""Token and sequence masks that restrict the policy term of the loss (TRL 1.16's
top_entropy_quantile and off_policy_mask_threshold). Pure functions over (N, T) tensors."""

from __future__ import annotations

import torch
from torch import Tensor


def high_entropy_mask(entropies: Tensor, completion_mask: Tensor, top_entropy_quantile: float,
                      all_entropies: Tensor | None = None) -> Tensor:
    """Bool (N, T): the completion tokens whose entropy is at least the (1 - top_entropy_quantile)
    quantile of the entropies of all completion tokens ("Beyond the 80/20 rule"; TRL's
    get_high_entropy_mask). all_entropies: the 1-D entropies the quantile is taken over (every
    process's tokens of this micro-step); default: this tensor's completion tokens. 1.0 keeps
    every token, 0.0 only the highest."""
    if not 0.0 <= top_entropy_quantile <= 1.0:
        raise ValueError(f"top_entropy_quantile must be in [0, 1], got {top_entropy_quantile}")
    mask = completion_mask.bool()
    pool = entropies[mask].float() if all_entropies is None else all_entropies.float()
    if pool.numel() == 0:
        return torch.zeros_like(mask)
    threshold = torch.quantile(pool, 1.0 - top_entropy_quantile)
    return ((entropies.float() * mask.float()) >= threshold) & mask   # compared as quantiled


def off_policy_mask(advantages: Tensor, logps: Tensor, sampler_logps: Tensor,
                    completion_mask: Tensor, threshold: float) -> Tensor:
    """(N, 1) in the dtype of completion_mask: 0 for a sequence with a negative advantage (N,) whose
    mean token KL(sampler || policy) = mean(sampler_logps - logps) exceeds threshold, else 1
    (DeepSeek-V3.2's off-policy sequence masking; TRL's get_off_policy_mask). NaN sampler log-probs
    count as no evidence (0)."""
    mask = completion_mask.to(logps.dtype)
    kl = torch.nan_to_num(sampler_logps - logps.detach(), nan=0.0)
    mean_kl = (kl * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1.0)
    keep = (advantages.reshape(-1, 1) >= 0) | (mean_kl <= threshold)
    return keep.to(completion_mask.dtype)
