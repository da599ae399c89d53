"""What asynchronous rollouts pass between the trainer and its generator: a round to sample
(RolloutTask), the round as sampled (Sampled: every training process's part), one process's part
of it (Arrival), and a generator's failure (Failure, raised on the trainer's side)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from cppo.sampling.batches import Completions, PromptBatch


@dataclass
class RolloutTask:
    """One round to sample: each training process's rows (its questions, in rank order) and the
    round index that seeds it. spans: the parts to sample, (rank, start, stop) each, rows
    start:stop of that process's (one generator process's share of the round:
    cppo.sampling.generator_pool); None: every process's rows whole."""

    task_id: int
    round_index: int
    rows: list[list[dict]]
    spans: list[tuple[int, int, int]] | None = None

    def parts(self) -> list[tuple[int, int, int]]:
        """(rank, start, stop) of each part to sample, in order."""
        if self.spans is not None:
            return self.spans
        return [(rank, 0, len(rows)) for rank, rows in enumerate(self.rows)]


@dataclass
class Sampled:
    """A round as the generator sampled it: the policy version that sampled it, each process's
    prompts (Q rows) and completions (Q x G rows), in rank order (a task with spans: one per
    span, in its order), the seconds it took, the seconds the generator waited for the task and,
    with tools, each process's tool-loop turns (Arrival)."""

    task_id: int
    version: int
    prompts: list[PromptBatch]
    completions: list[Completions]
    seconds: float
    idle_seconds: float = 0.0
    turns: list[dict] | None = None

    def part(self, rank: int) -> "Arrival":
        return Arrival(self.task_id, self.version, self.prompts[rank], self.completions[rank],
                       self.seconds, self.idle_seconds,
                       None if self.turns is None else self.turns[rank])


@dataclass
class Arrival:
    """This process's part of a sampled round: the policy version that sampled it, the prompts
    (Q rows), completions (Q x G rows), the seconds the sampling took and the seconds the
    generator waited for the task before (idle_seconds: 0 for its first task); turns: with tools,
    what the generator's tool loop kept of this part (cppo.sampling.rollout_generator.RoundTools:
    the rollouts' chat messages and the tools/* metrics), None without."""

    task_id: int
    version: int
    prompts: PromptBatch
    completions: Completions
    seconds: float
    idle_seconds: float = 0.0
    turns: dict | None = None

    def to(self, device) -> "Arrival":
        return dataclasses.replace(self, prompts=self.prompts.to(device),
                                   completions=self.completions.to(device))


@dataclass
class Failure:
    """A generator's failure (its traceback), sent in place of a round."""

    text: str
