"""A round's metrics (TRL's names plus cppo/...) and the run counters it adds to, from the
round's values; the counters themselves live in the run state (cppo.run.checkpoint.RunState)."""

from __future__ import annotations

import torch

from cppo.algorithm import reward_stats
from cppo.run.tracking import length_metrics


def model_token_lengths(completions) -> torch.Tensor:
    """(N,) float: each completion's tokens, a tool's left out (TRL: the model's tokens)."""
    if completions.tool_mask is None:
        return completions.lengths.float()
    return (completions.mask * completions.tool_mask).sum(-1).float()


def round_metrics(*, questions: int, all_rewards: torch.Tensor, reward_means: dict,
                  advantages: torch.Tensor, keep_mask: torch.Tensor, completions, scale_rewards,
                  num_generations: int, skipped_prompts: int | None = None,
                  two_stage: dict | None = None, two_stage_k: int = 0) -> dict:
    """The round's metrics: reward statistics of every process's rewards `all_rewards` (Q, G),
    the reward functions' means, completion lengths, what selection kept (keep_mask (Q, G) of
    this process's advantages), skip_zero_variance_prompts' and two_stage_generations' counts
    (None: off) and the sampler's statistics."""
    lengths = model_token_lengths(completions)
    abs_adv, pruned = advantages.abs(), ~keep_mask
    metrics = {**reward_stats(all_rewards, scale_rewards),
               **reward_means, **length_metrics(lengths, completions.truncated),
               "cppo/skipped": 0, "cppo/nonfinite": 0,   # 1 when so (a window: the fraction)
               "cppo/questions_per_step": questions,
               "cppo/completions_scored": keep_mask.numel(),
               "cppo/completions_kept": int(keep_mask.sum()),
               "cppo/kept_fraction": float(keep_mask.float().mean()),
               "cppo/mean_abs_advantage_kept": float(abs_adv[keep_mask].mean()) if keep_mask.any() else 0.0,
               "cppo/mean_abs_advantage_pruned": float(abs_adv[pruned].mean()) if pruned.any() else 0.0}
    if skipped_prompts is not None:
        metrics["cppo/skipped_prompts"] = skipped_prompts
        metrics["cppo/skipped_completions"] = skipped_prompts * num_generations
    if two_stage is not None:
        metrics["cppo/two_stage_dropped"] = two_stage["dropped"]
        metrics["cppo/two_stage_explored"] = two_stage["explored"]
        metrics["cppo/two_stage_saved_completions"] = two_stage["dropped"] * (num_generations - two_stage_k)
    for stats in (completions.speculation, completions.decode):
        if stats is not None:
            metrics.update(stats.metrics())
    return metrics


def round_counts(*, questions: int, scored: int, completions, prompts, num_generations: int,
                 skipped_prompts: int | None = None, two_stage: dict | None = None,
                 two_stage_k: int = 0) -> dict:
    """What the round adds to the run counters, on this process ("num_tokens": TRL's prompt +
    completion tokens, this process's; the caller sums it over processes)."""
    lengths = model_token_lengths(completions)
    counts = {"questions_seen": questions, "completions_scored": scored,
              "tokens_generated": int(lengths.sum())}
    if skipped_prompts is not None:
        counts["prompts_skipped"] = skipped_prompts
    if two_stage is not None:   # the dropped questions' first-stage completions count too
        counts["two_stage_dropped"] = two_stage["dropped"]
        counts["completions_scored"] += two_stage["dropped_here"] * two_stage_k
        counts["tokens_generated"] += two_stage["dropped_tokens"]
    per_question = len(prompts) != len(completions.ids)   # rollouts: a prompt each
    prompt_tokens = int(prompts.mask.sum()) * (num_generations if per_question else 1)
    counts["num_tokens"] = prompt_tokens + int(lengths.sum())
    return counts
