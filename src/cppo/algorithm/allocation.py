"""How many questions to sample, completions to score and completions to keep per step.

B = completions_per_update (completions in one optimizer update: TRL's
per_device_train_batch_size x gradient_accumulation_steps; with TRL's steps_per_generation, the
round's per_device_train_batch_size x steps_per_generation, trained on in slices),
G = group_size, P = pruning_rate.

  P = 0 (GRPO):          Q = B / G, scored = kept = B.
  allocation=False:      Q = B / G, scored = B; kept = max(1, round(B (1-P))) for scope 'step',
                         Q * max(1, round(G (1-P))) for scope 'question'.
  allocation=True (CPPO dynamic completion allocation, the kept completions fill the update):
    scope 'step':        Q = ceil(B / (G (1-P))), scored = Q G, kept = B; works for any P, the
                         effective pruning rate 1 - B / (Q G) is then >= P.
    scope 'question':    keep_per_question = max(1, round(G (1-P))) must divide B; Q = B / it.

Rounding: round half up (2.5 -> 3); round and ceil forgive float noise of 1e-9 so that e.g.
P = 0.8 gives exactly 16 / (16 * 0.2) = 5 questions, not 6.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cppo.algorithm.selection import SCOPES
_FLOAT_NOISE = 1e-9


@dataclass(frozen=True)
class StepShape:
    """Counts for one optimizer step; keep_per_question is None for scope 'step'."""

    questions_per_step: int
    completions_scored: int
    completions_kept: int
    keep_per_question: int | None

    def _group_size(self) -> int:
        return self.completions_scored // self.questions_per_step

    def _effective_pruning_rate(self) -> float:
        """Fraction of scored completions that are pruned: 1 - kept / scored."""
        return 1.0 - self.completions_kept / self.completions_scored

    # properties written as calls: mutmut does not mutate a decorated function
    group_size = property(_group_size, doc="Completions scored per question.")
    effective_pruning_rate = property(_effective_pruning_rate,
                                      doc="Fraction of scored completions that are pruned: 1 - kept / scored.")


def _round_half_up(value: float) -> int:
    return math.floor(value + 0.5 + _FLOAT_NOISE)


def _ceil(value: float) -> int:
    return math.ceil(value - _FLOAT_NOISE)


def check_pruning(pruning_rate: float, group_size: int) -> None:
    """P in [0, 1) (1 would prune every completion), and pruning needs G >= 2: the advantages of a
    group of one are all 0. Raises ValueError saying which."""
    if not isinstance(pruning_rate, (int, float)) or not 0.0 <= pruning_rate < 1.0:
        raise ValueError(f"the pruning rate P must lie in [0, 1) (1 would prune every "
                         f"completion), got {pruning_rate!r}")
    if pruning_rate > 0 and group_size < 2:
        raise ValueError(f"pruning (P = {pruning_rate}) needs groups of G >= 2 completions per "
                         f"question (the advantages of a group of one are all 0), got G = "
                         f"{group_size}")


def completions_kept(questions: int, group_size: int, pruning_rate: float, *,
                     question_scope: bool) -> int:
    """Completions kept of `questions` x `group_size` scored at P = pruning_rate (module doc's
    allocation=False counts): max(1, round(G (1-P))) per question (scope 'question'), or
    max(1, round(Q G (1-P))) over the step."""
    if question_scope:
        return questions * max(1, _round_half_up(group_size * (1.0 - pruning_rate)))
    return max(1, _round_half_up(questions * group_size * (1.0 - pruning_rate)))


def questions_per_chunk(chunk_size: int | None, group_size: int, num_questions: int) -> int:
    """Questions decoded together when at most `chunk_size` completions fit (None: all
    `num_questions`): whole groups, rounded down, at least one question."""
    return num_questions if chunk_size is None else max(1, chunk_size // group_size)


def even_blocks(count: int, parts: int) -> list[range]:
    """`count` items (a round's groups, or its generation chunks) cut into `parts` contiguous
    ranges in order, one per generator, of sizes that differ by at most one: the first
    count % parts ranges get the extra item; a range is empty when count < parts. A group is
    never split: each item goes whole to one generator."""
    size, extra = divmod(count, parts)
    bounds = [0]
    for k in range(parts):
        bounds.append(bounds[-1] + size + (k < extra))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def plan_step(
    *,
    completions_per_update: int,
    group_size: int,
    pruning_rate: float,
    allocation: bool,
    scope: str,
) -> StepShape:
    """The StepShape for B = completions_per_update, G = group_size, P = pruning_rate (module doc)."""
    batch, pruning = completions_per_update, pruning_rate
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"completions_per_update must be an int >= 1, got {batch!r}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
    check_pruning(pruning, group_size)
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")

    def questions_from_whole_groups() -> int:
        if batch % group_size != 0:
            raise ValueError(
                f"completions_per_update={batch} must be divisible by group_size={group_size} "
                f"(pruning_rate={pruning}, allocation={allocation}, scope={scope!r})"
            )
        return batch // group_size

    keep_fraction = 1.0 - pruning
    keep_per_question = max(1, _round_half_up(group_size * keep_fraction))
    question_scope = scope == "question"

    if pruning == 0:
        questions = questions_from_whole_groups()
        return StepShape(questions, batch, batch, group_size if question_scope else None)

    if not allocation:
        questions = questions_from_whole_groups()
        kept = completions_kept(questions, group_size, pruning, question_scope=question_scope)
        return StepShape(questions, batch, kept, keep_per_question if question_scope else None)

    if question_scope:
        if batch % keep_per_question != 0:
            raise ValueError(
                f"completions_per_update={batch} must be divisible by keep_per_question="
                f"{keep_per_question} (= {group_size} * (1 - {pruning}) rounded half up) for allocation with "
                "scope='question'; change the batch or the pruning rate, or use scope='step'"
            )
        questions = batch // keep_per_question
        return StepShape(questions, questions * group_size, batch, keep_per_question)

    questions = _ceil(batch / (group_size * keep_fraction))
    return StepShape(questions, questions * group_size, batch, None)


def total_steps(max_steps: int, num_rows: int, questions_per_round: int, num_train_epochs: float,
                steps_per_round: int) -> int:
    """Optimizer steps of a run: max_steps when > 0, else num_train_epochs passes over num_rows
    questions, questions_per_round a round (all processes'), steps_per_round optimizer steps a
    round (num_iterations x the round's slices, TRL's steps_per_generation)."""
    if max_steps > 0:
        return max_steps
    per_epoch = math.ceil(num_rows / questions_per_round)
    return max(1, int(per_epoch * num_train_epochs) * steps_per_round)
