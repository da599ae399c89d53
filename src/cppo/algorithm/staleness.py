"""Asynchronous rollouts' rules: policy versions, staleness and how far generation runs ahead.

A policy version is the number of optimizer steps taken. A group sampled with version `v` and
trained on at version `now` is `now - v` versions stale; one staler than `max_staleness` never
reaches the loss. Generation runs ahead of training by whole rounds (each round is
num_iterations optimizer steps), so a round submitted `k` rounds early is at least
`k * num_iterations` versions stale when it is trained on, plus up to `weight_sync_steps - 1`
versions the generator's weights lag between two pushes.
"""

from __future__ import annotations


def staleness(version_now: int, version_sampled: int) -> int:
    """Versions between the policy that sampled a group and the one about to train on it."""
    return version_now - version_sampled


def is_stale(version_now: int, version_sampled: int, max_staleness: int) -> bool:
    return staleness(version_now, version_sampled) > max_staleness


def rounds_in_flight(max_inflight_tasks: int, max_staleness: int, questions_per_round: int) -> int:
    """Rounds the generator may hold (submitted, not yet trained on), the round being waited for
    included. max_inflight_tasks counts groups (questions) as TRL's does; -1 (auto): the round
    trained next and max_staleness more (TRL's auto, max_staleness steps of samples in flight)."""
    if max_inflight_tasks == -1:
        return max_staleness + 1
    return max(1, max_inflight_tasks // questions_per_round)


def lookahead_rounds(max_staleness: int, num_iterations: int, in_flight: int,
                     weight_sync_steps: int = 1) -> int:
    """Rounds submitted beyond the one trained next: as many as keep a group within
    max_staleness, at most in_flight - 1. A round k rounds ahead is trained on k x
    num_iterations versions later, and the weights it was sampled with may already lag
    weight_sync_steps - 1 versions (pushes come every weight_sync_steps steps), so
    k <= (max_staleness - (weight_sync_steps - 1)) / num_iterations. max_staleness 0: none, so
    each round is sampled by the policy that trains on it."""
    room = max(0, max_staleness - (weight_sync_steps - 1))
    return min(room // num_iterations, in_flight - 1)


def push_due(step: int, last_push: int, weight_sync_steps: int) -> bool:
    """Whether the weights go to the generator now: weight_sync_steps optimizer steps since the
    last push."""
    return step - last_push >= weight_sync_steps

