"""Zero-variance prompt skipping: predict, from a question's reward history, that its next group
of G completions would all get the same reward (advantage 0 for every one: nothing to learn, and
CPPO would prune them all first), and skip rolling it out.

A question's history is its streak: how many of its latest groups in a row had zero reward
variance (0 for a question never seen, or whose latest group varied). It is rolled out with
probability keep_probability(streak) = max(floor, 2^-streak): always when the streak is 0, half
the time after one zero-variance group, a quarter after two, and never less than the exploration
floor, so a question the policy has stopped learning from is still revisited and its streak
reset when its rewards vary again (the policy changes; a solved question can become unsolved).
"""

from __future__ import annotations

import torch
from torch import Tensor


def zero_variance_groups(rewards: Tensor) -> Tensor:
    """(Q,) bool: the groups of rewards (Q, G) whose rewards are all equal (every advantage 0)."""
    return (rewards == rewards[:, :1]).all(dim=1)


def updated_streaks(streaks: Tensor, zero_variance: Tensor) -> Tensor:
    """Streaks (Q,) after one more group each: +1 where zero_variance (Q,), else reset to 0."""
    return torch.where(zero_variance, streaks + 1, torch.zeros_like(streaks))


def keep_probability(streaks: Tensor, floor: float) -> Tensor:
    """P(rolled out) (Q,) of questions with these zero-variance streaks (Q,): max(floor, 2^-streak)."""
    return torch.pow(0.5, streaks.double()).clamp(min=floor)
