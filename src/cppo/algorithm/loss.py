"""The GRPO clipped surrogate loss per token, and its reductions (TRL's loss_type).

N sequences (kept completions) x T tokens. completion_mask (N, T), bool or float, marks the real
completion tokens; padding never contributes and never produces NaN.
"""

from __future__ import annotations

import torch
from torch import Tensor

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """sum(values * mask) / sum(mask), over all entries or along `dim`; 0 where the mask is empty.

    Masked-out values are ignored even when they are NaN or inf.
    """
    weights = mask.to(values.dtype)
    weighted = torch.where(weights != 0, values * weights, torch.zeros_like(values))
    if dim is None:
        return weighted.sum() / weights.sum().clamp(min=1.0)
    return weighted.sum(dim=dim) / weights.sum(dim=dim).clamp(min=1.0)


def per_token_policy_loss(
    logps: Tensor,
    old_logps: Tensor | None,
    advantages: Tensor,
    *,
    epsilon_low: float,
    epsilon_high: float,
    beta: float = 0.0,
    ref_logps: Tensor | None = None,
    sampling_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token loss (N, T) = -w min(rho A, clip(rho, 1-eps_low, 1+eps_high) A) + beta * KL_k3.

    logps: (N, T) log-probs of the sampled tokens under the policy (carries the gradient);
    old_logps: (N, T) under the policy that sampled them (None = logps.detach(), i.e. rho = 1,
    for num_iterations = 1); ref_logps: (N, T) under the reference model, needed when beta > 0;
    advantages: (N,). rho = exp(logps - old_logps); KL_k3 = exp(ref - logp) - (ref - logp) - 1.
    sampling_weights: (N, T) importance weights of a sampler that is not the policy
    (`importance_weights`); they multiply the policy term only, never the KL term (as TRL).
    Stats (N, T), detached: kl (zeros without ref_logps), is_low_clipped (rho < 1 - eps_low and
    A < 0), is_high_clipped (rho > 1 + eps_high and A > 0), is_region_clipped (either) -- TRL's
    clip_ratio/low_mean, high_mean, region_mean once masked-averaged.
    """
    if logps.dim() != 2:
        raise ValueError(f"logps must be (sequences, tokens), got shape {tuple(logps.shape)}")
    if old_logps is None:
        old_logps = logps.detach()
    if old_logps.shape != logps.shape:
        raise ValueError(f"old_logps shape {tuple(old_logps.shape)} must equal logps shape {tuple(logps.shape)}")
    if ref_logps is not None and ref_logps.shape != logps.shape:
        raise ValueError(f"ref_logps shape {tuple(ref_logps.shape)} must equal logps shape {tuple(logps.shape)}")
    if beta != 0.0 and ref_logps is None:
        raise ValueError(f"beta={beta} adds a KL penalty and needs ref_logps; pass ref_logps or beta=0")
    if advantages.dim() == 2 and advantages.shape[1] == 1:
        advantages = advantages.squeeze(1)
    if advantages.shape != (logps.shape[0],):
        raise ValueError(
            f"advantages must have shape ({logps.shape[0]},) = one per sequence, got {tuple(advantages.shape)}"
        )
    if epsilon_low < 0 or epsilon_high < 0:
        raise ValueError(f"epsilon_low and epsilon_high must be >= 0, got {epsilon_low} and {epsilon_high}")

    advantages = advantages.detach().to(logps.dtype).unsqueeze(1)  # (N, 1)
    ratio = torch.exp(logps - old_logps.detach())
    clipped_ratio = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    per_token_loss = -torch.min(ratio * advantages, clipped_ratio * advantages)
    if sampling_weights is not None:
        if sampling_weights.shape != logps.shape:
            raise ValueError(f"sampling_weights shape {tuple(sampling_weights.shape)} must equal "
                             f"logps shape {tuple(logps.shape)}")
        per_token_loss = per_token_loss * sampling_weights.detach()

    if ref_logps is not None:
        ref_minus_logp = ref_logps.detach() - logps
        kl = torch.exp(ref_minus_logp) - ref_minus_logp - 1.0
    else:
        kl = torch.zeros_like(logps)
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * kl

    with torch.no_grad():
        is_low_clipped = (ratio < 1.0 - epsilon_low) & (advantages < 0)
        is_high_clipped = (ratio > 1.0 + epsilon_high) & (advantages > 0)
    stats = {
        "kl": kl.detach(),
        "is_low_clipped": is_low_clipped,
        "is_high_clipped": is_high_clipped,
        "is_region_clipped": is_low_clipped | is_high_clipped,
    }
    return per_token_loss, stats


def importance_weights(policy_logps: Tensor, sampler_logps: Tensor, clip_max: float) -> Tensor:
    """Truncated importance weights (N, T) = min(exp(policy - sampler), clip_max), detached: they
    re-weight each token's loss when the tokens were drawn from a sampler (e.g. a bfloat16 copy)
    that differs slightly from the policy whose log-probs the loss uses (TRL's token_truncate)."""
    if policy_logps.shape != sampler_logps.shape:
        raise ValueError(f"policy_logps {tuple(policy_logps.shape)} and sampler_logps "
                         f"{tuple(sampler_logps.shape)} must have the same shape")
    return torch.exp(policy_logps.detach() - sampler_logps.detach()).clamp(max=clip_max)


def reduce_loss(
    per_token: Tensor,
    completion_mask: Tensor,
    loss_type: str,
    *,
    max_completion_length: int,
    total_sequences: int | None = None,
    total_tokens: int | float | Tensor | None = None,
    accumulation_steps: int = 1,
) -> Tensor:
    """Scalar loss of one micro-batch from the per-token loss (N, T) and completion_mask (N, T).

    grpo:    sum over sequences of (masked token mean) / total_sequences
    bnpo:    sum(l * m) / (this micro-batch's tokens) / accumulation_steps   (TRL: the local
             micro-batch's active tokens, averaged over the accumulation steps)
    dr_grpo: sum(l * m) / (total_sequences * max_completion_length)
    dapo:    sum(l * m) / total_tokens                     (the whole update's tokens, TRL)
    total_sequences / total_tokens default to this micro-batch's counts; pass those of the whole
    update (all accumulation steps and processes) so the micro-batch losses SUM to the full-batch
    loss. bnpo never uses total_tokens: each micro-batch is normalised by its own tokens, so bnpo
    differs from dapo whenever micro-batches hold different numbers of tokens. A sequence with no
    mask tokens contributes 0 (it still counts as a sequence).
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if per_token.dim() != 2 or completion_mask.shape != per_token.shape:
        raise ValueError(
            f"per_token and completion_mask must both be (sequences, tokens); got "
            f"{tuple(per_token.shape)} and {tuple(completion_mask.shape)}"
        )
    if max_completion_length < 1:
        raise ValueError(f"max_completion_length must be >= 1, got {max_completion_length}")
    if total_sequences is not None and total_sequences < 1:
        raise ValueError(f"total_sequences must be >= 1, got {total_sequences}")
    if total_tokens is not None and total_tokens < 0:
        raise ValueError(f"total_tokens must be >= 0, got {total_tokens}")
    if accumulation_steps < 1:
        raise ValueError(f"accumulation_steps must be >= 1, got {accumulation_steps}")

    num_sequences = max(total_sequences if total_sequences is not None else per_token.shape[0], 1)
    mask = completion_mask.to(per_token.dtype)
    masked_sum = torch.where(mask != 0, per_token * mask, torch.zeros_like(per_token)).sum()
    if loss_type == "grpo":
        return masked_mean(per_token, mask, dim=1).sum() / num_sequences
    if loss_type == "dr_grpo":
        return masked_sum / (num_sequences * max_completion_length)
    if loss_type == "bnpo":
        return masked_sum / mask.sum().clamp(min=1.0) / accumulation_steps
    if total_tokens is None:
        tokens = mask.sum()
    else:
        tokens = torch.as_tensor(total_tokens, dtype=per_token.dtype, device=per_token.device)
    return masked_sum / tokens.clamp(min=1.0)
