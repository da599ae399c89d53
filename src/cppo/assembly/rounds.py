"""A round's values stage by stage (`Rollout`, then `Round`), its metrics (TRL's names plus
cppo/...) and what it adds to the run counters (which live in the run state,
cppo.run.checkpoint.RunState)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cppo.algorithm import reward_stats
from cppo.features.two_stage import TwoStageCounts
from cppo.rewards.runner import Scores
from cppo.run.batch import StepBatch
from cppo.run.metrics import model_token_lengths
from cppo.run.tracking import length_metrics
from cppo.sampling.batches import Completions, PromptBatch


@dataclass
class Rollout:
    """The generation stage: this process's questions (rows; two_stage: the continued ones),
    their indices in the question stream (order: all processes'), the prompts and completions,
    the questions passed over (skip_zero_variance_prompts; None: off), two_stage_generations'
    counts (None: off) and the stage's own metrics (async_rollout: the generator's)."""

    rows: list[dict]
    order: list[int]
    prompts: PromptBatch
    completions: Completions
    skipped_prompts: int | None = None
    two_stage: TwoStageCounts | None = None
    metrics: dict = field(default_factory=dict)


@dataclass
class Round:
    """A round after scoring and selection: its rollout, the scores, the advantages and
    keep_mask (Q, G), and the kept batch the updates train on."""

    rollout: Rollout
    scores: Scores
    advantages: torch.Tensor
    keep_mask: torch.Tensor
    batch: StepBatch


def round_metrics(done: Round, all_rewards: torch.Tensor, *, scale_rewards,
                  num_generations: int) -> dict:
    """The round's metrics: reward statistics of every process's rewards `all_rewards` (Q, G),
    the reward functions' means, completion lengths, what selection kept, skip_zero_variance_prompts'
    counts (when on) and the sampler's statistics (two_stage_generations' own: its feature's)."""
    rollout, keep_mask = done.rollout, done.keep_mask
    completions, skipped = rollout.completions, rollout.skipped_prompts
    lengths = model_token_lengths(completions)
    abs_adv, pruned = done.advantages.abs(), ~keep_mask
    metrics = {**reward_stats(all_rewards, scale_rewards),
               **done.scores.means, **length_metrics(lengths, completions.truncated),
               "cppo/skipped": 0, "cppo/nonfinite": 0,   # 1 when so (a window: the fraction)
               "cppo/questions_per_step": len(rollout.rows),
               "cppo/completions_scored": done.scores.rewards.numel(),
               "cppo/completions_kept": int(keep_mask.sum()),
               "cppo/kept_fraction": float(keep_mask.float().mean()),
               "cppo/mean_abs_advantage_kept": float(abs_adv[keep_mask].mean()) if keep_mask.any() else 0.0,
               "cppo/mean_abs_advantage_pruned": float(abs_adv[pruned].mean()) if pruned.any() else 0.0}
    if skipped is not None:
        metrics["cppo/skipped_prompts"] = skipped
        metrics["cppo/skipped_completions"] = skipped * num_generations
    for stats in (completions.speculation, completions.decode):
        if stats is not None:
            metrics.update(stats.metrics())
    return metrics


def round_counts(done: Round, *, num_generations: int) -> dict:
    """What the round adds to the run counters, on this process ("num_tokens": TRL's prompt +
    completion tokens, this process's; the caller sums it over processes; two_stage_generations'
    dropped questions: its feature's)."""
    rollout = done.rollout
    completions, prompts = rollout.completions, rollout.prompts
    lengths = model_token_lengths(completions)
    counts = {"questions_seen": len(rollout.rows), "completions_scored": done.scores.rewards.numel(),
              "tokens_generated": int(lengths.sum())}
    if rollout.skipped_prompts is not None:
        counts["prompts_skipped"] = rollout.skipped_prompts
    per_question = len(prompts) != len(completions.ids)   # rollouts: a prompt each
    prompt_tokens = int(prompts.mask.sum()) * (num_generations if per_question else 1)
    counts["num_tokens"] = prompt_tokens + int(lengths.sum())
    return counts
