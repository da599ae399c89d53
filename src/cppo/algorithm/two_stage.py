"""Two-stage draw (two_stage_generations = k): which questions get the rest of their group.

Each round first samples k < G completions per question and scores them. A question whose k
rewards are all equal is likely to have a zero-variance group of G (every advantage 0: nothing to
learn, and CPPO prunes such completions first), so only questions whose k rewards differ get
their other G - k completions, plus each all-equal one with probability `exploration` (a seeded
draw, the same on every process), so no question is systematically dropped on k samples' word.
A dropped question contributes no completions to the step (its k would have advantage 0); a
continued one ends with exactly G, its k first-stage completions reused.

Under several processes every process continues the same number of questions (the tensors the
processes gather must have one shape): the most any process's rule continues, at least one; a
process below that count adds its dropped questions, lowest exploration draw first. They cost no
wall time: that process would otherwise wait for the slowest one.
"""

from __future__ import annotations

from torch import Tensor

from cppo.algorithm.allocation import completions_kept
from cppo.algorithm.skipping import zero_variance_groups


def continued_questions(first_rewards: Tensor, draws: Tensor, exploration: float) -> Tensor:
    """(Q,) bool: the questions whose first-stage rewards (Q, k) differ, or whose uniform draw
    (Q,) in [0, 1) is below `exploration`."""
    return ~zero_variance_groups(first_rewards) | (draws.to(first_rewards.device) < exploration)


def balanced_continued(keep: Tensor, draws: Tensor) -> Tensor:
    """keep (W, Q) bool per process -> (W, Q) with the same count K = max(1, max_w keep[w].sum())
    on every process: a process below K adds its dropped questions in increasing order of their
    draws (W, Q)."""
    count = max(1, int(keep.sum(dim=1).max()))
    out = keep.clone()
    for w in range(keep.shape[0]):
        need = count - int(keep[w].sum())
        if need > 0:
            dropped = (~keep[w]).nonzero().squeeze(1)
            out[w, dropped[draws[w, dropped].argsort()[:need]]] = True
    return out


def completions_to_keep(plan, questions: int, group_size: int,
                        pruning_rate: float | None = None) -> int:
    """Completions the selection keeps when a step planned as `plan` (a StepShape) scores only
    `questions` groups: the plan's count when all are there; otherwise keep_per_question each
    (scope 'question'), or the plan's count capped at what there is (scope 'step').
    pruning_rate (pruning_rate: auto): the rate now, applied to the groups there are in the
    plan's scope, whatever the plan's own rate."""
    if pruning_rate is not None:
        return completions_kept(questions, group_size, pruning_rate,
                                question_scope=plan.keep_per_question is not None)
    if questions == plan.questions_per_step:
        return plan.completions_kept
    if plan.keep_per_question is not None:
        return questions * plan.keep_per_question
    return min(plan.completions_kept, questions * group_size)
