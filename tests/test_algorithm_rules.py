"""Rules of algorithm/ that only a trainer-level or torchrun test reached: normalize_then_sum's
NaN for a completion no reward applies to, PODS's advantages under batch scaling with one kept
completion, the round's selection (its rule, its generator, the global scope over processes)
and the reference model's mix. Small float64 tensors against values derived by hand."""

import math

import pytest
import torch

from cppo.algorithm import (keep_highest_scores, local_scope, mix_into_reference,
                            normalized_reward_sum, recompute_advantages_on_kept)
from cppo.algorithm.advantages import ADVANTAGE_EPS, round_advantages
from cppo.algorithm.selection import round_keep_mask, select_global

D = torch.float64
NAN = float("nan")
EPS = ADVANTAGE_EPS


def t(values):
    return torch.tensor(values, dtype=D)


# ------------------------------------------------------------------------- advantages


def test_normalize_then_sum_by_hand():
    # one question, G = 4, two functions; completion 3: no function applies
    per_function = t([[[1.0, NAN], [3.0, 2.0], [NAN, 6.0], [NAN, NAN]]])
    got = normalized_reward_sum(per_function, t([2.0, 0.5]))
    # f0 over {1, 3}: mean 2, unbiased std sqrt(2); f1 over {2, 6}: mean 4, std 2 sqrt(2)
    s0, s1 = math.sqrt(2) + EPS, 2 * math.sqrt(2) + EPS
    expected = [2 * (-1 / s0), 2 * (1 / s0) + 0.5 * (-2 / s1), 0.5 * (2 / s1)]
    assert got[0, :3].tolist() == pytest.approx(expected, rel=1e-12)
    assert math.isnan(got[0, 3].item())
    # default weights are ones; a function's lone value in its group normalises to 0
    lone = normalized_reward_sum(t([[[5.0, 1.0], [NAN, 3.0]]]))
    assert lone[0].tolist() == pytest.approx([0.0 + -1 / s0, 1 / s0], rel=1e-12)
    with pytest.raises(ValueError, match="questions, group_size, functions"):
        normalized_reward_sum(t([[1.0, 2.0]]))


def test_normalize_then_sum_advantages_refuse_a_completion_without_reward():
    per_function = t([[1.0, NAN], [3.0, 2.0], [NAN, NAN]])
    rewards = t([[1.0, 5.0, NAN]])
    with pytest.raises(ValueError, match=r"NaN at \(question, completion\) \[\(0, 2\)\]"):
        round_advantages(rewards, per_function, None, aggregation="normalize_then_sum",
                         scale_rewards="group", gather=lambda x: x)


def test_normalize_then_sum_advantages_are_batch_normalised_sums():
    per_function = t([[1.0, 0.0], [3.0, 0.0], [5.0, 1.0], [7.0, 1.0]])   # (Q G, F), Q = 2, G = 2
    rewards = t([[1.0, 3.0], [6.0, 8.0]])
    got = round_advantages(rewards, per_function, None, aggregation="normalize_then_sum",
                           scale_rewards="none", gather=lambda x: x)
    s = math.sqrt(2) + EPS            # f0's group std; f1: 0 in the first group, std 0 in the second
    summed = [-1 / s, 1 / s, -1 / s, 1 / s]
    std = torch.tensor(summed, dtype=D).std().item()
    expected = [[v / (std + EPS) for v in summed[:2]], [v / (std + EPS) for v in summed[2:]]]
    torch.testing.assert_close(got, t(expected))
    # the other aggregation: group advantages of the summed rewards with the gathered batch
    wide = t([[0.0, 10.0], [1.0, 3.0], [6.0, 8.0]])
    got = round_advantages(rewards, per_function, None, aggregation="sum_then_normalize",
                           scale_rewards="batch", gather=lambda x: wide)
    torch.testing.assert_close(got, t([[-1.0, 1.0], [-1.0, 1.0]]) / (wide.std() + EPS))


def test_pods_batch_scaling_with_one_kept_completion_gives_zero():
    rewards = t([[1.0, 5.0, 3.0]])
    got = recompute_advantages_on_kept(rewards, t([[0, 1, 0]]).bool(), "batch")
    assert got.tolist() == [[0.0, 0.0, 0.0]]
    got = recompute_advantages_on_kept(t([[1.0, 5.0, 3.0], [2.0, 4.0, 9.0]]),
                                       t([[0, 1, 1], [1, 1, 0]]).bool(), "batch")
    std = t([5.0, 3.0, 2.0, 4.0]).std().item()   # the unbiased std of every kept reward
    torch.testing.assert_close(got, t([[0.0, 1.0, -1.0], [-1.0, 1.0, 0.0]]) / (std + EPS))
    none = recompute_advantages_on_kept(t([[1.0, 5.0, 3.0]]), t([[0, 1, 1]]).bool(), "none")
    assert none.tolist() == [[0.0, 1.0, -1.0]]
    group = recompute_advantages_on_kept(t([[1.0, 5.0, 2.0]]), t([[1, 1, 1]]).bool(), "group")
    std = math.sqrt(((1 - 8 / 3) ** 2 + (5 - 8 / 3) ** 2 + (2 - 8 / 3) ** 2) / 2)
    assert group[0].tolist() == pytest.approx([(r - 8 / 3) / (std + EPS) for r in (1, 5, 2)], rel=1e-12)


# ------------------------------------------------------------------------- the round's selection


def test_round_keep_mask_uses_its_rule():
    advantages = t([[0.1, -2.0, 0.5, 1.0]])
    common = dict(num_keep=2, scope="question", generator=None)
    smallest = round_keep_mask(advantages, advantages, rule="smallest_abs", **common)
    assert smallest.tolist() == [[True, False, True, False]]
    largest = round_keep_mask(advantages, advantages, rule="largest_abs", **common)
    assert largest.tolist() == [[False, True, False, True]]
    # max_variance ranks rewards, not advantages: rewards 0, 0, 1, 1 keep one low and one high
    rewards = t([[0.0, 0.0, 1.0, 1.0]])
    pods = round_keep_mask(t([[9.0, 8.0, 0.0, 0.0]]), rewards, rule="max_variance", **common)
    assert pods.tolist() == [[True, False, False, True]]


def test_round_keep_mask_random_rule_draws_from_its_generator():
    advantages = torch.zeros(2, 4, dtype=D)
    torch.manual_seed(0)   # the global generator: a different stream from the seeded one below
    got = round_keep_mask(advantages, advantages, num_keep=4, rule="random", scope="step",
                          generator=torch.Generator().manual_seed(7))
    scores = torch.rand((2, 4), generator=torch.Generator().manual_seed(7))
    assert torch.equal(got, keep_highest_scores(scores, num_keep=4, scope="step"))
    torch.manual_seed(7)
    again = round_keep_mask(advantages, advantages, num_keep=4, rule="random", scope="step",
                            generator=torch.Generator().manual_seed(7))
    assert torch.equal(again, got)


def test_global_scope_ranks_every_process_completions():
    mine, other = t([[0.1, -0.2]]), t([[3.0, -4.0]])
    kwargs = dict(num_keep=1, rule="largest_abs", generator=None, world_size=2)
    # the two processes' largest |A| are both on process 1: process 0 keeps none of its own
    rank0 = round_keep_mask(mine, mine, scope="global", rank=0,
                            gather=lambda x: torch.cat([x, other if x is mine else x]), **kwargs)
    rank1 = round_keep_mask(other, other, scope="global", rank=1,
                            gather=lambda x: torch.cat([mine, x]), **kwargs)
    assert rank0.tolist() == [[False, False]] and rank1.tolist() == [[True, True]]
    # on one process the global scope is the step scope (no gather)
    alone = round_keep_mask(t([[0.1, -0.2], [3.0, 0.0]]), t([[0.1, -0.2], [3.0, 0.0]]),
                            scope="global", rank=0, world_size=1, gather=None, num_keep=2,
                            rule="largest_abs", generator=None)
    assert alone.tolist() == [[False, True], [True, False]]
    assert local_scope("global") == "step" and local_scope("question") == "question"
    both = t([[0.1, -0.2], [3.0, -4.0], [0.5, 0.6]])
    assert select_global(both, both, num_keep=3, rows=slice(2, 3)).tolist() == [[False, True]]
    assert select_global(both, both, num_keep=3, rows=slice(0, 1)).tolist() == [[False, False]]


# ------------------------------------------------------------------------- the reference model


def test_mix_into_reference_by_hand():
    reference = [torch.nn.Parameter(t([1.0, 2.0])), torch.nn.Parameter(t([[4.0]]))]
    policy = [torch.nn.Parameter(t([3.0, 6.0])), torch.nn.Parameter(t([[0.0]]))]
    mix_into_reference(reference, policy, 0.25)   # parameters: only legal under no_grad
    assert reference[0].tolist() == [1.5, 3.0] and reference[1].tolist() == [[3.0]]
    mix_into_reference(reference, policy, 0.0)
    assert reference[0].tolist() == [1.5, 3.0]
    mix_into_reference(reference, iter(policy), 1.0)
    assert reference[0].tolist() == [3.0, 6.0] and reference[1].tolist() == [[0.0]]
    assert reference[0].grad is None and policy[0].tolist() == [3.0, 6.0]
    for bad in (-0.1, 1.1):
        with pytest.raises(ValueError, match="alpha must be in"):
            mix_into_reference(reference, policy, bad)
    with pytest.raises(ValueError, match="reference has 2 parameters, policy 1"):
        mix_into_reference(reference, policy[:1], 0.5)


def test_round_keep_mask_defaults_are_one_process_rank_zero():
    advantages = t([[0.1, -0.2], [3.0, 0.0]])
    # world_size defaults to 1: the global scope is the step scope, no gather
    alone = round_keep_mask(advantages, advantages, num_keep=2, rule="largest_abs", scope="global",
                            generator=None)
    assert alone.tolist() == [[False, True], [True, False]]
    # rank defaults to 0: the rows of the first process
    other = t([[5.0, 0.3], [0.0, 0.0]])
    rows = round_keep_mask(advantages, advantages, num_keep=2, rule="largest_abs", scope="global",
                           generator=None, world_size=2, gather=lambda x: torch.cat([x, other]))
    # |A| over both processes: 5, 3, 0.3, 0.2 kept; rank 0 holds 0.2 and 3
    assert rows.tolist() == [[False, True], [True, False]]


def test_global_scope_uses_its_rule_and_generator():
    mine, other = t([[0.1, -0.2]]), t([[3.0, -4.0]])
    gather = lambda x: torch.cat([x, other])   # noqa: E731
    kwargs = dict(num_keep=1, scope="global", rank=0, world_size=2, gather=gather)
    smallest = round_keep_mask(mine, mine, rule="smallest_abs", generator=None, **kwargs)
    assert smallest.tolist() == [[True, True]]
    both = torch.cat([mine, other])
    assert select_global(both, both, num_keep=3, rows=slice(0, 1), rule="smallest_abs").tolist() == [[True, True]]
    # random: the scores come from the seeded generator, not the global one (16 completions)
    mine, other = torch.zeros(1, 8, dtype=D), torch.ones(1, 8, dtype=D)
    kwargs.update(num_keep=4, gather=lambda x: torch.cat([x, other]))
    scores = torch.rand((2, 8), generator=torch.Generator().manual_seed(3))
    expected = keep_highest_scores(scores, num_keep=8, scope="step")[0:1]
    torch.manual_seed(0)
    drawn = round_keep_mask(mine, mine, rule="random", generator=torch.Generator().manual_seed(3), **kwargs)
    assert torch.equal(drawn, expected)
    torch.manual_seed(0)
    direct = select_global(torch.cat([mine, other]), torch.cat([mine, other]), num_keep=8,
                           rows=slice(0, 1), rule="random", generator=torch.Generator().manual_seed(3))
    assert torch.equal(direct, expected)
    torch.manual_seed(0)
    unseeded = select_global(torch.cat([mine, other]), torch.cat([mine, other]), num_keep=8,
                             rows=slice(0, 1), rule="random")
    assert not torch.equal(unseeded, expected)   # the global stream (seed 0) draws another subset


def test_normalize_then_sum_advantages_use_the_weights_and_the_gathered_batch():
    per_function = t([[1.0, 0.0], [3.0, 2.0], [5.0, 1.0], [7.0, 1.0]])   # (Q G, F), Q = 2, G = 2
    rewards = t([[1.0, 3.0], [6.0, 8.0]])
    s = math.sqrt(2) + EPS   # f0's std in each group, f1's in the first (0 in the second)
    summed = [-1 / s - 0.5 / s, 1 / s + 0.5 / s, -1 / s, 1 / s]   # weights 1, 0.5
    other = t([[0.0, 10.0]])   # another process's sums: gather stacks them under this one's
    got = round_advantages(rewards, per_function, t([1.0, 0.5]), aggregation="normalize_then_sum",
                           scale_rewards="none", gather=lambda x: torch.cat([x, other]))
    std = torch.cat([t([summed]).view(2, 2), other]).std().item()
    expected = [[v / (std + EPS) for v in summed[:2]], [v / (std + EPS) for v in summed[2:]]]
    torch.testing.assert_close(got, t(expected), rtol=1e-12, atol=0.0)
    # sum_then_normalize: the batch std of the gathered summed rewards
    got = round_advantages(rewards, per_function, None, aggregation="sum_then_normalize",
                           scale_rewards="batch", gather=lambda x: torch.cat([x, other]))
    std = t([1.0, 3.0, 6.0, 8.0, 0.0, 10.0]).std()
    torch.testing.assert_close(got, t([[-1.0, 1.0], [-1.0, 1.0]]) / (std + EPS), rtol=1e-12, atol=0.0)
