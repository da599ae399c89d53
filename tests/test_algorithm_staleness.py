"""Asynchronous rollouts' pure rules (cppo.algorithm.staleness), against values derived by hand
from docs/asynchronous.md: exact integers and booleans, no timing.

Each case names in a comment the one-line change it turns red."""

import pytest

from cppo.algorithm.staleness import (is_stale, lookahead_rounds, push_due, rounds_in_flight,
                                      staleness)


def test_staleness_counts_the_versions_between_sampler_and_trainer():
    assert staleness(5, 3) == 2
    assert staleness(4, 4) == 0


@pytest.mark.parametrize("now, sampled, bound, stale", [
    (5, 3, 2, False),   # exactly at the bound: trained on (`>` into `>=` turns it red)
    (5, 2, 2, True),    # one beyond: dropped
    (3, 3, 0, False),   # max_staleness 0: the policy that trains on it sampled it
    (4, 3, 0, True),
])
def test_a_group_is_stale_only_beyond_max_staleness(now, sampled, bound, stale):
    assert is_stale(now, sampled, bound) is stale


@pytest.mark.parametrize("max_staleness, questions, rounds", [
    (0, 4, 1),   # the round trained next only
    (1, 4, 2),
    (2, 3, 3),
    (4, 7, 5),   # auto never divides by the questions of a round
])
def test_auto_in_flight_is_the_next_round_and_max_staleness_more(max_staleness, questions, rounds):
    """-1 (auto): max_staleness + 1 rounds, whatever a round's size (`+ 1` into `+ 2` or
    dropping it, or dividing by the questions, turns it red)."""
    assert rounds_in_flight(-1, max_staleness, questions) == rounds


@pytest.mark.parametrize("tasks, questions, rounds", [
    (8, 4, 2),    # whole rounds of groups
    (10, 4, 2),   # a partial round does not count (`//` into `/`: 2.5)
    (12, 4, 3),
    (4, 4, 1),    # one round's groups: one round (max(2, ...) turns it red)
    (3, 4, 1),    # fewer groups than a round: still the round trained next (max into min: 0)
    (1, 4, 1),    # 1 is a count, not auto (`== -1` into `== 1` or `abs` gives max_staleness + 1)
])
def test_an_explicit_max_inflight_tasks_counts_whole_rounds_of_groups(tasks, questions, rounds):
    got = rounds_in_flight(tasks, 2, questions)   # max_staleness 2 would give 3 under auto
    assert got == rounds and isinstance(got, int)


@pytest.mark.parametrize("max_staleness, num_iterations, in_flight, ahead", [
    (2, 1, 3, 2),    # the auto setting: max_staleness rounds ahead
    (2, 1, 2, 1),    # capped at in_flight - 1 (the round trained next is one of them)
    (2, 1, 1, 0),    # nothing ahead when only the next round may be in flight
    (5, 1, 1, 0),
    (3, 1, 10, 3),   # a looser cap leaves the staleness bound
    (3, 2, 5, 1),    # a round is num_iterations versions: 3 // 2 (`//` into `/`: 1.5)
    (4, 2, 10, 2),   # (`//` into `*` gives 8)
    (1, 2, 3, 0),    # a round ahead would already be 2 versions stale
    (0, 1, 1, 0),    # max_staleness 0: each round sampled by the policy that trains on it
])
def test_lookahead_keeps_a_round_within_max_staleness_and_the_in_flight_cap(
        max_staleness, num_iterations, in_flight, ahead):
    got = lookahead_rounds(max_staleness, num_iterations, in_flight)
    assert got == ahead and isinstance(got, int)


@pytest.mark.parametrize("max_staleness, num_iterations, weight_sync_steps, ahead", [
    (1, 1, 2, 0),    # weights up to 1 version old already: no room to run ahead
    (2, 1, 2, 1),    # one version of lag, one round ahead
    (3, 1, 2, 2),
    (4, 2, 3, 1),    # (4 - 2) // 2
    (2, 1, 3, 0),    # the lag takes all of max_staleness
    (0, 1, 1, 0),
])
def test_lookahead_leaves_room_for_the_weights_lag_between_pushes(
        max_staleness, num_iterations, weight_sync_steps, ahead):
    """A round sampled with weights weight_sync_steps - 1 versions behind and trained k rounds
    later is k x num_iterations + weight_sync_steps - 1 stale: within max_staleness."""
    got = lookahead_rounds(max_staleness, num_iterations, 10, weight_sync_steps)
    assert got == ahead
    assert got * num_iterations + weight_sync_steps - 1 <= max_staleness


@pytest.mark.parametrize("step, last_push, every, due", [
    (3, 2, 1, True),    # every step: one step since the last push
    (2, 2, 1, False),   # pushed at this version already
    (4, 2, 2, True),    # weight_sync_steps 2: two steps since
    (3, 2, 2, False),   # one step since (`step + last_push` = 5 >= 2 turns it red)
    (5, 2, 2, True),
    (1, 0, 2, False),   # from the first push at 0 (`>=` into `>` turns (4, 2, 2) red)
])
def test_a_push_is_due_weight_sync_steps_after_the_last(step, last_push, every, due):
    assert push_due(step, last_push, every) is due
