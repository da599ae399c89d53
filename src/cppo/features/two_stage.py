"""two_stage_generations = k: each round samples k completions per question first, scores them,
and samples the other G - k only for the questions cppo.algorithm.two_stage continues (the same
decision on every process). The draw, its counts and their metrics live here; the feature has no
state between rounds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from cppo.algorithm.skipping import zero_variance_groups
from cppo.algorithm.two_stage import balanced_continued, continued_questions
from cppo.sampling.batches import Completions, PromptBatch, group_rows, merge_groups
from cppo.sampling.generation import Generation
from cppo.sampling.sampler import chunk_seed


@dataclass(frozen=True)
class TwoStageCounts:
    """A round's counts: the questions not continued after the first stage (dropped: every
    process's; dropped_here: this process's), the continued ones whose first stage had zero
    reward variance (explored), and this process's dropped questions' first-stage completion
    tokens (dropped_tokens)."""

    dropped: int
    dropped_here: int
    explored: int
    dropped_tokens: int


@dataclass(frozen=True)
class TwoStageDraw:
    """The second stage's outcome: the continued rows, their prompts, G completions each (the
    k first-stage ones first) and the round's counts."""

    rows: list[dict]
    prompts: PromptBatch
    completions: Completions
    counts: TwoStageCounts


class TwoStage:
    """k = two_stage_generations first-stage completions per question; exploration: the chance
    a question whose k rewards are all equal is continued anyway (two_stage_exploration)."""

    name = "two_stage"

    def __init__(self, k: int, exploration: float) -> None:
        self.k, self.exploration = k, exploration

    def draw(self, generation: Generation, rows: list[dict], round_index: int, *,
             score: Callable[[list[dict], Completions, int], torch.Tensor], dist) -> TwoStageDraw:
        """k completions per row, scored (`score(rows, completions, k)` -> rewards (Q, k)); the
        other G - k only for the rows continued, decided on every process's first-stage rewards
        (hook: the generation stage)."""
        k, q, rank, device = self.k, len(rows), generation.rank, generation.device
        prompts = generation.prompts(rows)
        with generation.engine.gathered():
            first = generation.backend.generate(prompts, round_index=round_index,
                                                question_offset=rank * q, num_generations=k)
        first_rewards = dist.gather(score(rows, first, k)).cpu()
        gen = torch.Generator().manual_seed(chunk_seed(generation.seed, round_index, -2_000))
        draws = torch.rand(len(first_rewards), generator=gen, dtype=torch.float64)
        keep = continued_questions(first_rewards, draws, self.exploration)
        keep = balanced_continued(keep.view(-1, q), draws.view(-1, q))
        mine = keep[rank].nonzero().squeeze(1)
        with generation.engine.gathered():
            second = generation.backend.generate(prompts.select(mine.to(device)),
                                                 round_index=round_index,
                                                 question_offset=rank * len(mine),
                                                 num_generations=generation.num_generations - k,
                                                 stage=2)
        dropped_here = (~keep[rank]).nonzero().squeeze(1).to(first.mask.device)
        counts = TwoStageCounts(
            dropped=int((~keep).sum()), dropped_here=len(dropped_here),
            explored=int((keep & zero_variance_groups(first_rewards).view(-1, q)).sum()),
            dropped_tokens=int(first.mask[group_rows(dropped_here, k)].sum()))
        merged = merge_groups(first, k, mine, second, generation.tokenizer.pad_token_id)
        return TwoStageDraw([rows[i] for i in mine.tolist()], prompts.select(mine.to(device)),
                            merged, counts)

    def metrics(self, counts: TwoStageCounts, num_generations: int) -> dict:
        """The round's cppo/two_stage_* metrics (hook: the round's metrics)."""
        return {"cppo/two_stage_dropped": counts.dropped,
                "cppo/two_stage_explored": counts.explored,
                "cppo/two_stage_saved_completions": counts.dropped * (num_generations - self.k)}

    def counted(self, counts: TwoStageCounts) -> dict:
        """What the round adds to the run counters besides its kept completions: the dropped
        questions' first-stage completions and tokens (hook: counting the round)."""
        return {"two_stage_dropped": counts.dropped,
                "completions_scored": counts.dropped_here * self.k,
                "tokens_generated": counts.dropped_tokens}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
