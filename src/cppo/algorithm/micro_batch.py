"""One micro-batch's loss and its statistics, and a step's metrics from their sums: the
optimizer step (`CPPOTrainer.update`) is a loop over `micro_batch_loss` and a backward.

`settings` holds the objective's values (`LossSettings`; the run's config makes it:
`CPPOConfig.loss_settings()`); `micro` a batch of K completions with fields completion-shaped
(K, T): loss_mask, advantages (K,), old_logps, ref_logps, sampler_logps (each None when absent)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from cppo.algorithm.loss import Objective, entropy_bonus, per_token_policy_loss, reduce_loss
from cppo.algorithm.masks import high_entropy_mask, off_policy_mask
from cppo.algorithm.sampler_correction import sampler_correction_stats, sampler_importance_weights

SUM_KEYS = ("loss", "kl", "low", "high", "region", "tokens", "entropy", "ratio_sum", "ratio_count",
            "logp_diff_sum", "logp_diff_count", "bonus_entropy", "bonus_tokens")
MAX_KEYS = ("ratio_max", "ratio_min_neg", "logp_diff_max")


@dataclass(frozen=True)
class LossSettings:
    """The values one micro-batch's loss reads: KL, the masks on the policy term, the sampler
    correction, whether an entropy bonus is on, and the objective (`Objective`: loss_type,
    clipping, importance_sampling_level, delta, ...)."""
    beta: float
    max_completion_length: int
    top_entropy_quantile: float   # 1.0: no entropy mask
    off_policy_mask_threshold: float | None
    importance_sampling_mode: str
    importance_sampling_clip_min: float | None
    importance_sampling_clip_max: float | None
    entropy_bonus: bool
    objective: Objective

    @property
    def loss_type(self) -> str:
        return self.objective.loss_type


def entropy_bonus_on(entropy_coef: float, adaptive: bool) -> bool:
    """TRL: a fixed coefficient > 0, or adaptive control (on even while its coefficient is 0)."""
    return entropy_coef > 0 or adaptive


def empty_sums() -> dict:
    """A step's running sums (0) and maxima (-inf) over its micro-batches."""
    return {**{key: 0 if key == "tokens" else 0.0 for key in SUM_KEYS},
            **{key: -math.inf for key in MAX_KEYS}}


def add_micro_batch(totals: dict, part: dict) -> None:
    """Add one micro-batch's statistics (micro_batch_loss's) to the step's totals."""
    for key, value in part.items():
        totals[key] = max(totals[key], value) if key in MAX_KEYS else totals[key] + value


def policy_mask(micro, logps: Tensor, entropies: list[Tensor], settings: LossSettings) -> Tensor | None:
    """The mask (K, T) or (K, 1) on the policy term: top_entropy_quantile (over this
    micro-batch's tokens) and off_policy_mask_threshold (KL of the sampler: the recorded sampler
    log-probs, else the old policy's); None when neither is on."""
    mask = None
    if settings.top_entropy_quantile < 1.0:
        mask = high_entropy_mask(torch.cat(entropies), micro.loss_mask,
                                 settings.top_entropy_quantile).float()
    if settings.off_policy_mask_threshold is not None:
        sampler = next(t for t in (micro.sampler_logps, micro.old_logps, logps.detach())
                       if t is not None)
        keep = off_policy_mask(micro.advantages, logps, sampler, micro.loss_mask.float(),
                               settings.off_policy_mask_threshold)
        mask = keep if mask is None else mask * keep
    return mask


def sampler_weights(micro, logps: Tensor, settings: LossSettings) -> tuple[Tensor | None, dict]:
    """Importance weights for completions another sampler drew (vLLM, a cast copy), over the
    model's tokens only (a tool's have no sampler log-prob, TRL's mask), and their statistics;
    (None, {}) when the micro-batch has no sampler log-probs."""
    if micro.sampler_logps is None:
        return None, {}
    old = logps.detach().float() if micro.old_logps is None else micro.old_logps
    weights = sampler_importance_weights(
        old, micro.sampler_logps, micro.loss_mask, settings.importance_sampling_mode,
        settings.importance_sampling_clip_min, settings.importance_sampling_clip_max)
    stats = sampler_correction_stats(old, micro.sampler_logps, micro.loss_mask, weights)
    part = {key: float(stats[key]) for key in ("ratio_sum", "ratio_count", "logp_diff_sum",
                                               "logp_diff_count")}
    part.update(ratio_max=float(stats["ratio_max"]), ratio_min_neg=-float(stats["ratio_min"]),
                logp_diff_max=float(stats["logp_diff_max"]))
    return weights.expand_as(logps), part   # sequence modes: (K, 1) -> every token


def micro_batch_loss(logps: Tensor, entropies: list[Tensor], micro, settings: LossSettings, *,
                     entropy_coef: float,
                     total_sequences: int, total_tokens: int,
                     num_micro: int) -> tuple[Tensor, dict]:
    """The loss of one micro-batch (a scalar to backward; its share of the step's loss) from the
    policy's log-probs (K, T) and token entropies (chunks of (K, T)), and its statistics (sums
    and maxima for add_micro_batch; not "loss", which the caller adds after its scaling)."""
    weights, part = sampler_weights(micro, logps, settings)
    mask = policy_mask(micro, logps.float(), entropies, settings)
    per_token, stats = per_token_policy_loss(   # IS weights on the policy term only (TRL)
        logps.float(), micro.old_logps, micro.advantages, settings.objective, beta=settings.beta,
        ref_logps=micro.ref_logps, sampling_weights=weights, completion_mask=micro.loss_mask,
        policy_mask=mask)
    loss = reduce_loss(per_token, micro.loss_mask, settings.loss_type,
                       max_completion_length=settings.max_completion_length,
                       total_sequences=total_sequences, total_tokens=total_tokens,
                       accumulation_steps=num_micro)
    if settings.entropy_bonus:   # on the tokens the policy term trains (TRL)
        trained = micro.loss_mask if settings.top_entropy_quantile >= 1.0 \
            else micro.loss_mask * high_entropy_mask(
                torch.cat(entropies).detach(), micro.loss_mask, settings.top_entropy_quantile)
        loss = loss - entropy_coef * entropy_bonus(torch.cat(entropies), trained, num_micro)
        part["bonus_entropy"] = float((torch.cat(entropies).detach() * trained).sum())
        part["bonus_tokens"] = float(trained.sum())
    m = micro.loss_mask.bool()
    part.update(kl=float(stats["kl"][m].sum()), low=float(stats["is_low_clipped"][m].sum()),
                high=float(stats["is_high_clipped"][m].sum()),
                region=float(stats["is_region_clipped"][m].sum()), tokens=int(m.sum()))
    if entropies:
        part["entropy"] = float(torch.cat(entropies).detach()[m].sum())
    return loss, part


def step_metrics(totals: dict, *, kl: bool, grad_norm: float, learning_rate: float,
                 entropy_coef: float | None, sampler_corrected: bool) -> dict:
    """A step's metrics (TRL's keys) from its totals over every micro-batch and process.
    kl: report the KL (beta > 0); entropy_coef: the coefficient to report (None: no entropy
    bonus)."""
    tokens = max(totals["tokens"], 1)
    metrics = {"loss": totals["loss"], "grad_norm": grad_norm,
               "clip_ratio/low_mean": totals["low"] / tokens,
               "clip_ratio/high_mean": totals["high"] / tokens,
               "clip_ratio/region_mean": totals["region"] / tokens,
               "entropy": totals["entropy"] / tokens, "learning_rate": learning_rate}
    if kl:
        metrics["kl"] = totals["kl"] / tokens
    if entropy_coef is not None:
        metrics["entropy_coef"] = entropy_coef
    if sampler_corrected:   # TRL's keys, over the kept batch (all processes)
        finite = lambda v: v if math.isfinite(v) else 0.0  # noqa: E731
        metrics["sampling/importance_sampling_ratio/min"] = finite(-totals["ratio_min_neg"])
        metrics["sampling/importance_sampling_ratio/mean"] = \
            totals["ratio_sum"] / max(totals["ratio_count"], 1.0)
        metrics["sampling/importance_sampling_ratio/max"] = finite(totals["ratio_max"])
        metrics["sampling/sampling_logp_difference/mean"] = \
            totals["logp_diff_sum"] / max(totals["logp_diff_count"], 1.0)
        metrics["sampling/sampling_logp_difference/max"] = finite(totals["logp_diff_max"])
    return metrics
