"""A round's generation stage: the G completions of each question through the generation
backend (cppo.sampling.backends), two_stage_generations' two stages, or a rollout function's
rollouts. Each returns its values; nothing is kept between rounds."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch

from cppo.algorithm.skipping import zero_variance_groups
from cppo.algorithm.two_stage import balanced_continued, continued_questions
from cppo.sampling.batches import Completions, PromptBatch, group_rows, merge_groups
from cppo.sampling.multi_turn import rollout_from_output
from cppo.sampling.sampler import chunk_seed, encode_prompts
from cppo.sampling.tools import ToolLoop


@dataclass(frozen=True)
class TwoStageCounts:
    """two_stage_generations' counts for a round: the questions not continued after the first
    stage (dropped: every process's; dropped_here: this process's), the continued ones whose
    first stage had zero reward variance (explored), and this process's dropped questions'
    first-stage completion tokens (dropped_tokens)."""

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


@dataclass(frozen=True)
class Generation:
    """What generation uses, set once per run: the backend, the tokenizer, the engine (its
    `gathered()` hands the sampler the full weights under fsdp, once per round), the device,
    this process's rank, the config's num_generations (G), max_prompt_length and seed."""

    backend: object
    tokenizer: object
    engine: object
    device: torch.device
    rank: int
    num_generations: int
    max_prompt_length: int | None
    seed: int

    def prompts(self, rows: list[dict]) -> PromptBatch:
        """The rows' prompts, encoded (left-padded) on the device."""
        return encode_prompts(self.tokenizer, [r["prompt"] for r in rows],
                              self.max_prompt_length).to(self.device)

    def sample(self, rows: list[dict], round_index: int) -> tuple[PromptBatch, Completions]:
        """G completions per row, seeded by (seed, round, the rows' place in the global batch)."""
        prompts = self.prompts(rows)
        with self.engine.gathered():      # fsdp: full weights once per round, not per token
            completions = self.backend.generate(prompts, round_index=round_index,
                                                question_offset=self.rank * len(rows))
        return prompts, completions

    def two_stage(self, rows: list[dict], round_index: int, *, k: int, exploration: float,
                  score: Callable[[list[dict], Completions, int], torch.Tensor], dist
                  ) -> TwoStageDraw:
        """two_stage_generations = k: k completions per row, scored (`score(rows, completions, k)`
        -> rewards (Q, k)); the other G - k only for the rows cppo.algorithm.two_stage continues
        (the same decision on every process, from all processes' first-stage rewards)."""
        q, rank = len(rows), self.rank
        prompts = self.prompts(rows)
        with self.engine.gathered():
            first = self.backend.generate(prompts, round_index=round_index,
                                          question_offset=rank * q, num_generations=k)
        first_rewards = dist.gather(score(rows, first, k)).cpu()
        gen = torch.Generator().manual_seed(chunk_seed(self.seed, round_index, -2_000))
        draws = torch.rand(len(first_rewards), generator=gen, dtype=torch.float64)
        keep = continued_questions(first_rewards, draws, exploration)
        keep = balanced_continued(keep.view(-1, q), draws.view(-1, q))
        mine = keep[rank].nonzero().squeeze(1)
        with self.engine.gathered():
            second = self.backend.generate(prompts.select(mine.to(self.device)),
                                           round_index=round_index,
                                           question_offset=rank * len(mine),
                                           num_generations=self.num_generations - k, stage=2)
        dropped_here = (~keep[rank]).nonzero().squeeze(1).to(first.mask.device)
        counts = TwoStageCounts(
            dropped=int((~keep).sum()), dropped_here=len(dropped_here),
            explored=int((keep & zero_variance_groups(first_rewards).view(-1, q)).sum()),
            dropped_tokens=int(first.mask[group_rows(dropped_here, k)].sum()))
        return TwoStageDraw([rows[i] for i in mine.tolist()], prompts.select(mine.to(self.device)),
                            merge_groups(first, k, mine, second, self.tokenizer.pad_token_id), counts)

    def rollout(self, rollout_func, rows: list[dict], round_index: int,
                caller) -> tuple[PromptBatch, Completions]:
        """TRL's rollout_func: called with each row's prompt G times (a copy) and `caller` (the
        trainer, as TRL passes it; cppo's tool loop gets its ToolContext); its output checked and
        padded (cppo.sampling.multi_turn), one prompt row per completion, the extra reward
        columns on the completions."""
        g = self.num_generations
        prompts = [copy.deepcopy(r["prompt"]) for r in rows for _ in range(g)]
        with self.engine.gathered():      # fsdp: the full weights, for the push and the sampling
            if prompts:   # vLLM: this round's weights
                probe = encode_prompts(self.tokenizer, prompts[:1], self.max_prompt_length)
                self.backend.sync_weights(round_index, probe=probe.ids[0].tolist())
            if isinstance(rollout_func, ToolLoop):   # environments are reset with the rows
                output = rollout_func(prompts, caller, rows=[r for r in rows for _ in range(g)])
            else:
                output = rollout_func(prompts, caller)
        self.backend.rest()    # as after the backend's own generation (sleep mode)
        out = rollout_from_output(output, len(prompts), eos_token_id=self.tokenizer.eos_token_id,
                                  pad_token_id=self.tokenizer.pad_token_id, device=self.device)
        return out.prompts, out.completions
