"""The GRPO family's per-token losses (TRL's loss_type), and their reductions.

N sequences (kept completions) x T tokens. completion_mask (N, T), bool or float, marks the real
completion tokens; padding never contributes and never produces NaN. Names and defaults are TRL
1.16's GRPOConfig's: loss_type, importance_sampling_level, delta, use_bias_correction_kl,
sapo_temperature_pos / _neg, vespo_k_pos / _lambda_pos / _k_neg / _lambda_neg (`Objective` holds
them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

# loss_type -> the policy term it uses ("clip": PPO's clipped surrogate)
POLICY_TERMS = {"grpo": "clip", "bnpo": "clip", "dr_grpo": "clip", "dapo": "clip", "luspo": "clip",
                "cispo": "cispo", "sapo": "sapo", "vespo": "vespo"}
LOSS_TYPES = tuple(POLICY_TERMS)
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
SEQUENCE_LEVEL_LOSSES = ("luspo",)   # TRL warns unless importance_sampling_level is sequence
TOKEN_SUM_LOSSES = ("bnpo", "dr_grpo", "dapo", "cispo")  # sum tokens: sequence level weights by length
# reduce_loss divides by a count of tokens (the rest: by a count of sequences)
TOKEN_NORMALISED_LOSSES = ("bnpo", "dapo", "cispo", "vespo")


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """sum(values * mask) / sum(mask), over all entries or along `dim`; 0 where the mask is empty.

    Masked-out values are ignored even when they are NaN or inf.
    """
    weights = mask.to(values.dtype)
    weighted = torch.where(weights != 0, values * weights, torch.zeros_like(values))
    if dim is None:
        return weighted.sum() / weights.sum().clamp(min=1.0)
    return weighted.sum(dim=dim) / weights.sum(dim=dim).clamp(min=1.0)


def importance_ratio(logps: Tensor, old_logps: Tensor, completion_mask: Tensor | None,
                     level: str = "token") -> Tensor:
    """rho = pi / pi_old: (N, T) per token, or (N, 1) per sequence (GSPO: exp of the masked mean
    of the token log-ratios). Carries the gradient of logps."""
    log_ratio = logps - old_logps.detach()
    if level == "token":
        return torch.exp(log_ratio)
    if level != "sequence":
        raise ValueError(f"importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}, "
                         f"got {level!r}")
    if completion_mask is None:
        raise ValueError("importance_sampling_level='sequence' needs completion_mask")
    mask = completion_mask.to(logps.dtype)
    return torch.exp((log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0))


def gamma_weights(advantages: Tensor, log_ratio: Tensor, completion_mask: Tensor,
                  sampling_weights: Tensor | None = None, *, k_pos: float = 2.0,
                  lambda_pos: float = 3.0, k_neg: float = 3.0, lambda_neg: float = 2.0) -> Tensor:
    """VESPO's weight (N, 1) phi(w) = exp(lambda + k log w - lambda w) of the sequence ratio
    w = exp(sum of the masked token log-ratios (+ log sampling_weights)), k and lambda by the sign
    of the advantage (N, 1); detached. Clamps as TRL: log-ratios to [-20, 20], log w to
    [log 1e-8, 20]."""
    low = math.log(1e-8)
    mask = completion_mask.to(log_ratio.dtype)
    seq = (log_ratio.clamp(-20.0, 20.0) * mask).sum(-1, keepdim=True)
    if sampling_weights is not None:
        seq = seq + torch.log(sampling_weights).clamp(low, 20.0).sum(-1, keepdim=True)
    log_w = seq.clamp(low, 20.0)
    nonneg = advantages >= 0
    k = torch.where(nonneg, log_w.new_tensor(k_pos), log_w.new_tensor(k_neg))   # log_w's dtype
    lam = torch.where(nonneg, log_w.new_tensor(lambda_pos), log_w.new_tensor(lambda_neg)).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


# decorators written as calls: mutmut does not mutate a decorated function (benchmarks/mutation.py)
gamma_weights = torch.no_grad()(gamma_weights)


@dataclass(frozen=True, kw_only=True)
class Objective:
    """The policy objective's hyperparameters (TRL 1.16 GRPOConfig's names):
    epsilon_low / epsilon_high: the clip range [1 - epsilon_low, 1 + epsilon_high] of the ratio
    (TRL's epsilon, epsilon_high; cispo caps the ratio at epsilon_high); loss_type: the policy
    term (POLICY_TERMS) and the reduction; importance_sampling_level: ratios per "token" or per
    "sequence" (GSPO); delta: two-sided clipping, the unclipped ratio capped at delta (None: off);
    use_bias_correction_kl: the KL term times the ratio; sapo_temperature_pos / _neg: sapo's
    gate temperature for A > 0 / A <= 0; vespo: `gamma_weights`' k_pos, lambda_pos, k_neg,
    lambda_neg (TRL's vespo_k_pos, ...; None or a missing key: its defaults)."""
    epsilon_low: float
    epsilon_high: float
    loss_type: str = "dapo"
    importance_sampling_level: str = "token"
    delta: float | None = None
    use_bias_correction_kl: bool = True
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo: dict[str, float] | None = None


def per_token_policy_loss(
    logps: Tensor, old_logps: Tensor | None, advantages: Tensor, objective: Objective, *,
    beta: float = 0.0, ref_logps: Tensor | None = None, sampling_weights: Tensor | None = None,
    completion_mask: Tensor | None = None, policy_mask: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token loss (N, T) = policy term * policy_mask * sampling_weights + beta * KL_k3 (* rho).

    logps: (N, T) log-probs of the sampled tokens under the policy (carries the gradient);
    old_logps: (N, T) under the policy that sampled them (None = logps.detach(), i.e. rho = 1,
    for num_iterations = 1); ref_logps: (N, T) under the reference model, needed when beta > 0;
    advantages: (N,). rho = `importance_ratio` (per token, or per sequence: GSPO). Policy term by
    the objective's loss_type: clipped (grpo, bnpo, dr_grpo, dapo, luspo) -min(rho' A, clip(rho,
    1-eps_low, 1+eps_high) A) with rho' = min(rho, delta) when delta is set (two-sided clipping);
    cispo -sg(min(rho, eps_high)) A logp; sapo -sigmoid(tau (rho - 1)) 4 / tau A, tau by the
    sign of A; vespo -`gamma_weights` A logp. KL_k3 = exp(ref - logp) - (ref - logp) - 1, times rho
    (with its gradient) when use_bias_correction_kl. sampling_weights: (N, T) importance weights
    of a sampler that is not the policy (`importance_weights`): they multiply the policy term only
    (vespo folds them into its weight), never the KL term (as TRL). policy_mask (N, T) or (N, 1):
    multiplies the policy term (high-entropy and off-policy masks).
    Stats (N, T), detached: kl (zeros without ref_logps), is_low_clipped (rho < 1 - eps_low and
    A < 0), is_high_clipped (rho > 1 + eps_high and A > 0), is_region_clipped (either) -- TRL's
    clip_ratio/low_mean, high_mean, region_mean once masked-averaged (cispo: rho > eps_high, A > 0).
    """
    advantages, old_logps, completion_mask = _checked_inputs(
        logps, old_logps, advantages, ref_logps, sampling_weights, completion_mask, objective,
        beta=beta)
    advantages = advantages.detach().to(logps.dtype).unsqueeze(1)  # (N, 1)
    ratio = importance_ratio(logps, old_logps, completion_mask, objective.importance_sampling_level)
    term = POLICY_TERMS[objective.loss_type]
    per_token_loss = _policy_term(term, ratio, advantages, logps, old_logps, completion_mask,
                                  sampling_weights, objective)
    per_token_loss = per_token_loss.expand_as(logps)
    if policy_mask is not None:
        per_token_loss = per_token_loss * policy_mask.to(logps.dtype)
    if sampling_weights is not None and term != "vespo":
        per_token_loss = per_token_loss * sampling_weights.detach()

    if ref_logps is not None:
        ref_minus_logp = ref_logps.detach() - logps
        kl = torch.exp(ref_minus_logp) - ref_minus_logp - 1.0
    else:
        kl = torch.zeros_like(logps)
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * (kl * ratio if objective.use_bias_correction_kl else kl)

    clipped = _clip_stats(term, ratio, advantages, logps, objective.epsilon_low, objective.epsilon_high)
    stats = {"kl": kl.detach(), **clipped}
    return per_token_loss, stats


def _checked_inputs(logps: Tensor, old_logps: Tensor | None, advantages: Tensor,
                    ref_logps: Tensor | None, sampling_weights: Tensor | None,
                    completion_mask: Tensor | None, objective: Objective, *,
                    beta: float) -> tuple[Tensor, Tensor, Tensor]:
    """per_token_policy_loss's inputs checked: advantages (N,), old_logps (None: logps
    detached) and the completion mask (None: all ones)."""
    epsilon_low, epsilon_high = objective.epsilon_low, objective.epsilon_high
    if logps.dim() != 2:
        raise ValueError(f"logps must be (sequences, tokens), got shape {tuple(logps.shape)}")
    if objective.loss_type not in POLICY_TERMS:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {objective.loss_type!r}")
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
    if sampling_weights is not None and sampling_weights.shape != logps.shape:
        raise ValueError(f"sampling_weights shape {tuple(sampling_weights.shape)} must equal "
                         f"logps shape {tuple(logps.shape)}")
    if completion_mask is None:
        completion_mask = torch.ones_like(logps)
    return advantages, old_logps, completion_mask


def _policy_term(term: str, ratio: Tensor, advantages: Tensor, logps: Tensor, old_logps: Tensor,
                 completion_mask: Tensor, sampling_weights: Tensor | None,
                 objective: Objective) -> Tensor:
    """The policy term per token ((N, T), or (N, 1) for sequence-level ratios) of one loss
    family (POLICY_TERMS), advantages (N, 1)."""
    if term == "clip":
        clipped_ratio = torch.clamp(ratio, 1.0 - objective.epsilon_low, 1.0 + objective.epsilon_high)
        unclipped = ratio if objective.delta is None else torch.clamp(ratio, max=objective.delta)
        return -torch.min(unclipped * advantages, clipped_ratio * advantages)
    if term == "cispo":
        return -torch.clamp(ratio, max=objective.epsilon_high).detach() * advantages * logps
    if term == "sapo":
        tau = torch.where(advantages > 0, objective.sapo_temperature_pos,
                          objective.sapo_temperature_neg)
        return -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * advantages
    phi = gamma_weights(advantages, logps.detach() - old_logps.detach(), completion_mask,  # vespo
                        sampling_weights, **(objective.vespo or {}))
    return -phi * advantages * logps


def _clip_stats(term: str, ratio: Tensor, advantages: Tensor, logps: Tensor, epsilon_low: float,
                epsilon_high: float) -> dict[str, Tensor]:
    """(N, T) bool: where the ratio was clipped low and high, and either (cispo: high only)."""
    if term == "cispo":
        is_low_clipped = torch.zeros_like(logps, dtype=torch.bool)
        is_high_clipped = ((ratio > epsilon_high) & (advantages > 0)).expand_as(logps)
    else:
        is_low_clipped = ((ratio < 1.0 - epsilon_low) & (advantages < 0)).expand_as(logps)
        is_high_clipped = ((ratio > 1.0 + epsilon_high) & (advantages > 0)).expand_as(logps)
    return {"is_low_clipped": is_low_clipped, "is_high_clipped": is_high_clipped,
            "is_region_clipped": is_low_clipped | is_high_clipped}


_clip_stats = torch.no_grad()(_clip_stats)


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

    grpo, sapo: sum over sequences of (masked token mean) / total_sequences
    luspo:   sum(l * m) / total_sequences          (each sequence's token sum, TRL)
    bnpo:    sum(l * m) / (this micro-batch's tokens) / accumulation_steps   (TRL: the local
             micro-batch's active tokens, averaged over the accumulation steps)
    dr_grpo: sum(l * m) / (total_sequences * max_completion_length)
    dapo, cispo, vespo: sum(l * m) / total_tokens        (the whole update's tokens, TRL)
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
    if loss_type in ("grpo", "sapo"):
        return masked_mean(per_token, mask, dim=1).sum() / num_sequences
    if loss_type == "luspo":
        return masked_sum / num_sequences
    if loss_type == "dr_grpo":
        return masked_sum / (num_sequences * max_completion_length)
    if loss_type == "bnpo":
        return masked_sum / mask.sum().clamp(min=1.0) / accumulation_steps
    if total_tokens is None:
        tokens = mask.sum()
    else:
        tokens = torch.as_tensor(total_tokens, dtype=per_token.dtype, device=per_token.device)
    return masked_sum / tokens.clamp(min=1.0)


def entropy_bonus(entropies: Tensor, mask: Tensor, accumulation_steps: int = 1) -> Tensor:
    """The mean token entropy of one micro-batch, entropies (N, T) over mask (N, T), divided by
    the accumulation steps (TRL's entropy bonus; the loss subtracts entropy_coef times it)."""
    weights = mask.to(entropies.dtype)
    return (entropies * weights).sum() / weights.sum().clamp(min=1.0) / accumulation_steps


def router_aux_loss(aux_losses: list[Tensor], coef: float, accumulation_steps: int = 1) -> Tensor:
    """Mixture-of-experts load-balancing term of one micro-batch, as TRL adds it: coef x the mean
    of the model's aux_loss scalars (one per forward chunk) / accumulation_steps. Each process's
    own (the engines average gradients over processes, as TRL's do)."""
    return coef * torch.stack(aux_losses).mean() / accumulation_steps


def router_aux_coef(coef: float | None, has_router_logits: bool, model_coef: float | None) -> float:
    """TRL's rule for the load-balancing coefficient: the config's router_aux_loss_coef when set,
    else the model's own (0 when it declares none); 0 for a model without router logits (a
    coefficient > 0 there raises ValueError: there is no auxiliary loss to weight)."""
    if coef and not has_router_logits:
        raise ValueError(f"router_aux_loss_coef is {coef} but the model is not a mixture-of-"
                         f"experts model that returns its router logits")
    if not has_router_logits:
        return 0.0
    return float(model_coef or 0.0) if coef is None else float(coef)


def applied_entropy_coef(coef: float, last_entropy: float, target: float) -> float:
    """Adaptive entropy control (Skywork-OR1, TRL's use_adaptive_entropy): the coefficient a step
    applies, the current one when the previous step's mean token entropy was at or below the
    target, else 0 (before any step, last_entropy is inf: no bonus)."""
    return coef if last_entropy <= target else 0.0


def adapted_entropy_coef(coef: float, entropy: float, *, target: float, delta: float,
                         coef_min: float, coef_max: float) -> float:
    """Adaptive entropy control's update after a step whose mean token entropy (over every
    process's tokens the bonus acts on) was `entropy`: up by delta (capped at coef_max) when it
    is at or below the target, down by delta (floored at coef_min) otherwise."""
    if entropy <= target:
        return min(coef + delta, coef_max)
    return max(coef - delta, coef_min)
