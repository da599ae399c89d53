"""A round's values (`Round`), its metrics (TRL's names plus cppo/...) and what it adds to the
run counters (which live in the run state, cppo.run.checkpoint.RunState)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cppo.algorithm import reward_stats
from cppo.run.tracking import length_metrics


def model_token_lengths(completions) -> torch.Tensor:
    """(N,) float: each completion's tokens, a tool's left out (TRL: the model's tokens)."""
    if completions.tool_mask is None:
        return completions.lengths.float()
    return (completions.mask * completions.tool_mask).sum(-1).float()


@dataclass
class Round:
    """One round's values, stage by stage: this process's questions (rows; two_stage: the
    continued ones), their indices in the question stream (order: all processes'), the
    questions passed over (skip_zero_variance_prompts; None: off), the prompts (a PromptBatch)
    and completions (Completions), two_stage_generations' counts (None: off), the scores
    (cppo.rewards.runner.Scores), advantages and keep_mask (Q, G), and the kept batch."""
    rows: list[dict]
    order: list[int]
    skipped_prompts: int | None
    prompts: object
    completions: object
    two_stage: dict | None
    scores: object
    advantages: torch.Tensor
    keep_mask: torch.Tensor
    batch: object


def round_metrics(done: Round, all_rewards: torch.Tensor, *, scale_rewards, num_generations: int,
                  two_stage_k: int = 0) -> dict:
    """The round's metrics: reward statistics of every process's rewards `all_rewards` (Q, G),
    the reward functions' means, completion lengths, what selection kept, skip_zero_variance_prompts'
    and two_stage_generations' counts (when on) and the sampler's statistics."""
    completions, keep_mask, skipped, two_stage = (done.completions, done.keep_mask,
                                                  done.skipped_prompts, done.two_stage)
    lengths = model_token_lengths(completions)
    abs_adv, pruned = done.advantages.abs(), ~keep_mask
    metrics = {**reward_stats(all_rewards, scale_rewards),
               **done.scores.means, **length_metrics(lengths, completions.truncated),
               "cppo/skipped": 0, "cppo/nonfinite": 0,   # 1 when so (a window: the fraction)
               "cppo/questions_per_step": len(done.rows),
               "cppo/completions_scored": done.scores.rewards.numel(),
               "cppo/completions_kept": int(keep_mask.sum()),
               "cppo/kept_fraction": float(keep_mask.float().mean()),
               "cppo/mean_abs_advantage_kept": float(abs_adv[keep_mask].mean()) if keep_mask.any() else 0.0,
               "cppo/mean_abs_advantage_pruned": float(abs_adv[pruned].mean()) if pruned.any() else 0.0}
    if skipped is not None:
        metrics["cppo/skipped_prompts"] = skipped
        metrics["cppo/skipped_completions"] = skipped * num_generations
    if two_stage is not None:
        metrics["cppo/two_stage_dropped"] = two_stage["dropped"]
        metrics["cppo/two_stage_explored"] = two_stage["explored"]
        metrics["cppo/two_stage_saved_completions"] = two_stage["dropped"] * (num_generations - two_stage_k)
    for stats in (completions.speculation, completions.decode):
        if stats is not None:
            metrics.update(stats.metrics())
    return metrics


def round_counts(done: Round, *, num_generations: int, two_stage_k: int = 0) -> dict:
    """What the round adds to the run counters, on this process ("num_tokens": TRL's prompt +
    completion tokens, this process's; the caller sums it over processes)."""
    completions, prompts, two_stage = done.completions, done.prompts, done.two_stage
    lengths = model_token_lengths(completions)
    counts = {"questions_seen": len(done.rows), "completions_scored": done.scores.rewards.numel(),
              "tokens_generated": int(lengths.sum())}
    if done.skipped_prompts is not None:
        counts["prompts_skipped"] = done.skipped_prompts
    if two_stage is not None:   # the dropped questions' first-stage completions count too
        counts["two_stage_dropped"] = two_stage["dropped"]
        counts["completions_scored"] += two_stage["dropped_here"] * two_stage_k
        counts["tokens_generated"] += two_stage["dropped_tokens"]
    per_question = len(prompts) != len(completions.ids)   # rollouts: a prompt each
    prompt_tokens = int(prompts.mask.sum()) * (num_generations if per_question else 1)
    counts["num_tokens"] = prompt_tokens + int(lengths.sum())
    return counts


def crossed(step: int, every: int, num_iterations: int) -> bool:
    """True when the round that ended at optimizer step `step` (num_iterations steps a round)
    crossed a multiple of `every` steps."""
    before = (step - 1) // num_iterations * num_iterations   # the round's start
    return step // every > before // every
