"""Rewards -> group-relative advantages (GRPO), plus the reward metrics TRL logs.

Shapes: N completions = Q questions x G completions per question (question-major: completion
j of question i is flat row i * G + j). F reward functions.

NaN policy: a reward function returns NaN where it does not apply (TRL's None). `combine_rewards`
ignores those; a completion where *no* function applies gets NaN, and `group_advantages` refuses
NaN rewards with an error naming the positions, so a missing reward never becomes a silent 0.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

SCALE_REWARDS = ("group", "batch", "none")
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")   # TRL's multi_objective_aggregation


ADVANTAGE_EPS = 1e-4   # std + eps: the division's guard in every normalised advantage


def combine_rewards(per_function: Tensor, weights: Tensor | None = None) -> Tensor:
    """Weighted sum over reward functions, ignoring NaN entries (TRL's nansum of w * r).

    per_function: (N, F) float, NaN = "this function does not apply". weights: (F,) or None
    (all ones). Returns (N,). A row where every function is NaN gives NaN (TRL would give 0
    with a warning); `group_advantages` then raises, naming the completion.
    """
    if per_function.dim() != 2:
        raise ValueError(
            f"per_function must be (num_completions, num_functions), got shape {tuple(per_function.shape)}"
        )
    num_functions = per_function.shape[1]
    if weights is None:
        weights = torch.ones(num_functions, dtype=per_function.dtype, device=per_function.device)
    weights = torch.as_tensor(weights, dtype=per_function.dtype, device=per_function.device)
    if weights.shape != (num_functions,):
        raise ValueError(
            f"weights must have shape ({num_functions},) = one per reward function, got {tuple(weights.shape)}"
        )
    if not torch.isfinite(weights).all():
        raise ValueError(f"weights must be finite numbers, got {weights.tolist()}")
    applies = ~torch.isnan(per_function)
    weighted = torch.where(applies, per_function * weights, torch.zeros_like(per_function))
    combined = weighted.sum(dim=1)
    no_function_applies = ~applies.any(dim=1)
    return combined.masked_fill(no_function_applies, float("nan"))


def _check_rewards(rewards: Tensor) -> None:
    if rewards.dim() != 2:
        raise ValueError(
            f"rewards must be (questions, group_size), got shape {tuple(rewards.shape)}; "
            "reshape flat rewards with rewards.view(-1, group_size)"
        )
    nan_positions = torch.isnan(rewards).nonzero().tolist()
    if nan_positions:
        shown = [tuple(p) for p in nan_positions[:10]]
        raise ValueError(
            f"rewards are NaN at (question, completion) {shown}"
            f"{' ...' if len(nan_positions) > 10 else ''}: no reward function applied to "
            "these completions; every completion needs a reward"
        )


def check_scale_rewards(scale_rewards: str) -> None:
    """Raise ValueError unless scale_rewards is one of 'group', 'batch', 'none'."""
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")


def group_advantages(rewards: Tensor, scale_rewards: str = "group", eps: float = ADVANTAGE_EPS,
                     batch_rewards: Tensor | None = None) -> Tensor:
    """GRPO advantages: A = r - mean(group), optionally divided by a std + eps.

    rewards: (Q, G) -> (Q, G). scale_rewards 'group': unbiased std of each group; 'batch':
    unbiased std of all rewards of the batch (mean stays per group, as TRL): `batch_rewards`
    (Q_all, G) when the batch is wider than `rewards` (e.g. every process's groups), else the
    Q * G rewards themselves; 'none': no division.
    A group of size 1 has A = 0 (std undefined, and r - mean = 0). A group whose rewards are all
    equal gets A = 0 exactly, whatever the value (0.3 x G would otherwise leave a rounding residue
    of r - mean that the division by std + eps blows up to ~1e-4), so the zero-variance skip
    sees it.
    """
    _check_rewards(rewards)
    check_scale_rewards(scale_rewards)
    group_size = rewards.shape[1]
    if group_size < 2:
        return torch.zeros_like(rewards)
    all_equal = (rewards == rewards[:, :1]).all(dim=1, keepdim=True)
    centered = (rewards - rewards.mean(dim=1, keepdim=True)).masked_fill(all_equal, 0.0)
    if scale_rewards == "none":
        return centered
    if scale_rewards == "group":
        std = rewards.std(dim=1, keepdim=True)
    else:
        std = (rewards if batch_rewards is None else batch_rewards).std()
    return centered / (std + eps)


def recompute_advantages_on_kept(
    rewards: Tensor, keep_mask: Tensor, scale_rewards: str = "group", eps: float = ADVANTAGE_EPS
) -> Tensor:
    """PODS: advantages recomputed within each question's kept subset; 0 where not kept.

    rewards, keep_mask: (Q, G) -> (Q, G). Mean (and for 'group' the unbiased std) over the kept
    completions of each question; 'batch' divides by the unbiased std of all kept rewards.
    A question keeping 0 or 1 completions gets A = 0. Rewards of pruned completions are ignored
    (they may be NaN).
    """
    check_scale_rewards(scale_rewards)
    if rewards.dim() != 2 or keep_mask.shape != rewards.shape:
        raise ValueError(
            f"rewards and keep_mask must both be (questions, group_size); got {tuple(rewards.shape)} "
            f"and {tuple(keep_mask.shape)}"
        )
    kept = keep_mask.bool()
    if torch.isnan(rewards[kept]).any():
        raise ValueError("rewards of kept completions must not be NaN")
    kept_rewards = torch.where(kept, rewards, torch.zeros_like(rewards))
    count = kept.sum(dim=1, keepdim=True).to(rewards.dtype)
    mean = kept_rewards.sum(dim=1, keepdim=True) / count.clamp(min=1)
    centered = torch.where(kept, rewards - mean, torch.zeros_like(rewards))
    if scale_rewards == "none":
        return centered
    if scale_rewards == "group":
        variance = centered.pow(2).sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)
        std = variance.sqrt()
    else:
        values = rewards[kept]
        std = values.std() if values.numel() > 1 else rewards.new_zeros(())
    return centered / (std + eps)


def reward_stats(rewards: Tensor, scale_rewards: str = "group") -> dict[str, float]:
    """TRL's reward metrics for rewards (Q, G).

    reward: mean of all rewards; reward_std: the std the advantages are scaled by, averaged over
    completions: with scale_rewards group or none, the mean over groups of the unbiased group std;
    with batch, the unbiased std of all rewards; frac_reward_zero_std: fraction of groups whose
    rewards are all equal (these give A = 0), with batch 1 or 0 (is the batch std zero).
    Groups of size 1 count as zero std.
    """
    _check_rewards(rewards)
    if rewards.numel() == 0:
        return {"reward": float("nan"), "reward_std": float("nan"), "frac_reward_zero_std": float("nan")}
    if scale_rewards == "batch":
        std = rewards.std().item() if rewards.numel() > 1 else 0.0
        return {"reward": rewards.mean().item(), "reward_std": std,
                "frac_reward_zero_std": float(math.isclose(std, 0.0, abs_tol=1e-8))}
    if rewards.shape[1] < 2:
        group_std = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    else:
        group_std = rewards.std(dim=1)
    all_equal = (rewards == rewards[:, :1]).all(dim=1)
    return {
        "reward": rewards.mean().item(),
        "reward_std": group_std.mean().item(),
        "frac_reward_zero_std": all_equal.float().mean().item(),
    }


def normalized_reward_sum(per_function: Tensor, weights: Tensor | None = None,
                          eps: float = ADVANTAGE_EPS) -> Tensor:
    """GDPO's aggregation (TRL's multi_objective_aggregation: normalize_then_sum): each reward
    function's rewards are normalised within each group, (r - mean) / (std + eps) (unbiased std),
    then summed with the weights. per_function: (Q, G, F), NaN where a function does not apply
    (ignored in its group's statistics and in the sum); weights (F,). Returns (Q, G); the
    advantages are then these sums normalised over the whole batch (scale_rewards batch).
    A completion where no function applies gives NaN (`group_advantages` names it)."""
    if per_function.dim() != 3:
        raise ValueError(f"per_function must be (questions, group_size, functions), got shape "
                         f"{tuple(per_function.shape)}")
    applies = ~torch.isnan(per_function)
    values = torch.where(applies, per_function, torch.zeros_like(per_function))
    count = applies.sum(1, keepdim=True)
    mean = values.sum(1, keepdim=True) / count.clamp(min=1)
    var = (torch.where(applies, per_function - mean, torch.zeros_like(values)) ** 2).sum(
        1, keepdim=True) / (count - 1).clamp(min=1)
    normalized = (per_function - mean) / (var.sqrt() + eps)   # 0 for a function's lone value
    if weights is None:
        weights = torch.ones(per_function.shape[2], dtype=per_function.dtype)
    weighted = torch.where(applies, normalized * weights.to(per_function), torch.zeros_like(values))
    return weighted.sum(2).masked_fill(~applies.any(2), float("nan"))


def round_advantages(rewards: Tensor, per_function: Tensor, weights: Tensor | None, *,
                     aggregation: str, scale_rewards: str, gather) -> Tensor:
    """(Q, G): group-relative advantages of the summed rewards (Q, G), or, with the
    normalize_then_sum aggregation, of the per-function (N, F) normalised sums (normalised over
    the whole batch: `gather` collects every process's (Q, G))."""
    if aggregation == "normalize_then_sum":
        summed = normalized_reward_sum(per_function.view(*rewards.shape, -1), weights)
        return group_advantages(summed, "batch", batch_rewards=gather(summed))
    return group_advantages(rewards, scale_rewards, batch_rewards=gather(rewards))
