"""Importance weights against the sampler (cppo.algorithm.sampler_correction): the default bound,
and the statistics' shapes (one sequence, one token, two tokens), by hand."""

import math

import torch

from cppo.algorithm.sampler_correction import sampler_correction_stats, sampler_importance_weights

D = torch.float64
LN = math.log


def t(values):
    return torch.tensor(values, dtype=D)


def test_the_default_is_token_truncate_at_three():
    policy, sampler = t([[LN(3.5), LN(2.0)]]), t([[0.0, 0.0]])
    weights = sampler_importance_weights(policy, sampler, torch.ones(1, 2))
    assert weights.shape == (1, 2)
    assert weights[0, 0].item() == 3.0   # 3.5 truncated at clip_max 3
    assert abs(weights[0, 1].item() - 2.0) < 1e-6


def test_stats_of_one_sequence_in_a_sequence_mode():
    policy, sampler = t([[LN(2.0), 0.0, 0.0]]), t([[0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    weights = sampler_importance_weights(policy, sampler, mask, "sequence_mask", None, 10.0)
    assert weights.shape == (1, 1)
    stats = sampler_correction_stats(policy, sampler, mask, weights)
    assert stats["ratio_count"].item() == 1.0
    assert abs(stats["ratio_sum"].item() - 2.0) < 1e-6


def test_stats_of_two_token_sequences_in_a_sequence_mode():
    policy, sampler = t([[LN(2.0), 0.0], [0.0, LN(4.0)]]), torch.zeros(2, 2, dtype=D)
    mask = torch.tensor([[1, 1], [1, 0]])
    weights = sampler_importance_weights(policy, sampler, mask, "sequence_truncate", None, 10.0)
    stats = sampler_correction_stats(policy, sampler, mask, weights)
    # one weight a sequence: 2 and 1 (the second's 4 is masked out)
    assert stats["ratio_count"].item() == 2.0
    assert abs(stats["ratio_sum"].item() - 3.0) < 1e-6
    assert stats["logp_diff_count"].item() == 3.0


def test_stats_of_one_token_completions_in_a_token_mode_count_the_masked_tokens_only():
    policy, sampler = t([[LN(2.0)], [LN(3.0)], [0.0]]), torch.zeros(3, 1, dtype=D)
    mask = torch.tensor([[1], [0], [1]])
    weights = sampler_importance_weights(policy, sampler, mask, "token_truncate", None, 10.0)
    stats = sampler_correction_stats(policy, sampler, mask, weights)
    assert stats["ratio_count"].item() == 2.0
    assert abs(stats["ratio_sum"].item() - 3.0) < 1e-6
    assert abs(stats["ratio_max"].item() - 2.0) < 1e-6



def test_empty_stats_are_infinite():
    policy = torch.zeros(2, 2, dtype=D)
    stats = sampler_correction_stats(policy, policy, torch.zeros(2, 2), torch.ones(2, 2, dtype=D))
    assert stats["ratio_min"].item() == math.inf and stats["ratio_max"].item() == -math.inf
    assert stats["logp_diff_min"].item() == math.inf and stats["ratio_count"].item() == 0.0
