"""`pruning_rate: auto`'s controller (algorithm/balance.py) against values derived by hand: the
kept share keep = 1 - P moves by keep x gain x clamp((w - i) / s, -1, 1) and stays within
[1 - high, 1 - low]. Dyadic numbers, so every result is exact."""

import pytest

from cppo.algorithm.balance import GAIN, balanced_pruning_rate

RANGE = dict(low=0.5, high=0.9375)


def rate(pruning_rate, wait, idle, seconds, **kwargs):
    return balanced_pruning_rate(pruning_rate, trainer_wait=wait, generator_idle=idle,
                                 round_seconds=seconds, **{**RANGE, **kwargs})


def test_a_waiting_trainer_raises_the_kept_share_by_gain_times_the_error():
    # keep 0.25, error 0.5 / 1 = 0.5, gain 0.5: keep 0.25 x 1.25 = 0.3125
    assert rate(0.75, 0.5, 0.0, 1.0, gain=0.5) == 0.6875


def test_an_idle_generator_lowers_the_kept_share():
    # error -0.5: keep 0.25 x 0.75 = 0.1875
    assert rate(0.75, 0.0, 0.5, 1.0, gain=0.5) == 0.8125


def test_the_error_is_the_net_wait_over_the_rounds_sampling_time():
    # (0.75 - 0.25) / 2 = 0.25: keep 0.25 x 1.125 = 0.28125
    assert rate(0.75, 0.75, 0.25, 2.0, gain=0.5) == 0.71875


@pytest.mark.parametrize("wait, idle, expected", [(3.0, 0.0, 0.625), (0.0, 3.0, 0.875),
                                                  (1.0, 0.0, 0.625), (0.0, 1.0, 0.875)])
def test_the_error_is_clamped_to_one_either_way(wait, idle, expected):
    # error clamped to +-1: keep 0.25 x 1.5 or 0.25 x 0.5
    assert rate(0.75, wait, idle, 1.0, gain=0.5) == expected


def test_the_rate_is_clamped_to_its_range():
    # keep 0.5 x 1.5 = 0.75 > 1 - low = 0.5: rate low; keep 0.0625 x 0.5 < 1 - high: rate high
    assert rate(0.5, 1.0, 0.0, 1.0, gain=0.5) == 0.5
    assert rate(0.9375, 0.0, 1.0, 1.0, gain=0.5) == 0.9375
    # inside the range nothing is clamped: keep 0.375 x 1.25 = 0.46875
    assert rate(0.625, 0.5, 0.0, 1.0, gain=0.5) == 0.53125


def test_no_sampling_time_leaves_the_rate():
    assert rate(0.75, 1.0, 0.0, 0.0, gain=0.5) == 0.75
    assert rate(0.75, 0.0, 1.0, 0.0) == 0.75


def test_the_default_gain_is_gain():
    assert GAIN == 0.2
    assert rate(0.75, 1.0, 0.0, 1.0) == 1.0 - 0.25 * (1.0 + 0.2 * 1.0)
    assert rate(0.75, 0.0, 1.0, 1.0) == 1.0 - 0.25 * (1.0 + 0.2 * -1.0)
