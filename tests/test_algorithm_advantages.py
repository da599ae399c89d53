import math
import re

import pytest
import torch

from cppo.algorithm import combine_rewards, group_advantages, reward_stats

NAN = float("nan")


# ---------------------------------------------------------------- combine_rewards


def test_combine_rewards_weighted_sum_ignores_nan():
    per_function = torch.tensor(
        [
            [1.0, 0.5, NAN],  # third function does not apply
            [NAN, 2.0, 4.0],
            [0.0, 0.0, 0.0],
        ]
    )
    weights = torch.tensor([2.0, 1.0, 0.5])
    combined = combine_rewards(per_function, weights)
    # row 0: 2*1 + 1*0.5 = 2.5 ; row 1: 1*2 + 0.5*4 = 4.0 ; row 2: 0
    torch.testing.assert_close(combined, torch.tensor([2.5, 4.0, 0.0]))


def test_combine_rewards_default_weights_are_ones():
    per_function = torch.tensor([[1.0, 3.0], [NAN, -1.0]])
    torch.testing.assert_close(combine_rewards(per_function, None), torch.tensor([4.0, -1.0]))


def test_combine_rewards_row_with_no_applicable_function_is_nan():
    per_function = torch.tensor([[1.0, NAN], [NAN, NAN], [NAN, 2.0]])
    combined = combine_rewards(per_function, torch.tensor([1.0, 3.0]))
    assert combined[0].item() == 1.0
    assert math.isnan(combined[1].item())
    assert combined[2].item() == 6.0


def test_combine_rewards_zero_weight_times_nan_is_not_nan():
    per_function = torch.tensor([[NAN, 1.0]])
    assert combine_rewards(per_function, torch.tensor([0.0, 1.0])).item() == 1.0


def test_combine_rewards_bad_weights_shape():
    with pytest.raises(ValueError, match=r"weights must have shape \(2,\).*got \(3,\)"):
        combine_rewards(torch.zeros(4, 2), torch.ones(3))


def test_combine_rewards_bad_input_shape():
    with pytest.raises(ValueError, match=r"per_function must be .*got shape \(4,\)"):
        combine_rewards(torch.zeros(4), None)


def test_combine_rewards_nan_weight_rejected():
    with pytest.raises(ValueError, match="weights must be finite"):
        combine_rewards(torch.zeros(1, 2), torch.tensor([1.0, NAN]))


# ---------------------------------------------------------------- group_advantages

# rewards of 2 questions x 4 completions, values chosen so the stats are easy by hand
REWARDS = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 4.0, 6.0, 8.0]], dtype=torch.float64)
# question 0: mean 0.5, centered [.5, -.5, -.5, .5], unbiased std sqrt(1/3)
# question 1: mean 5,   centered [-3, -1, 1, 3],     unbiased std sqrt(20/3)
CENTERED = torch.tensor([[0.5, -0.5, -0.5, 0.5], [-3.0, -1.0, 1.0, 3.0]], dtype=torch.float64)


def test_group_advantages_scale_none_is_centering():
    torch.testing.assert_close(group_advantages(REWARDS, "none"), CENTERED)


def test_group_advantages_scale_group_hand_computed():
    eps = 1e-4
    expected = torch.tensor(
        [
            [v / (math.sqrt(1 / 3) + eps) for v in (0.5, -0.5, -0.5, 0.5)],
            [v / (math.sqrt(20 / 3) + eps) for v in (-3.0, -1.0, 1.0, 3.0)],
        ],
        dtype=torch.float64,
    )
    torch.testing.assert_close(group_advantages(REWARDS, "group", eps=eps), expected)


def test_group_advantages_scale_batch_hand_computed():
    # all 8 rewards: 1 0 0 1 2 4 6 8 -> mean 22/8 = 2.75
    values = [1, 0, 0, 1, 2, 4, 6, 8]
    mean = sum(values) / 8
    unbiased_std = math.sqrt(sum((v - mean) ** 2 for v in values) / 7)
    eps = 1e-4
    expected = CENTERED / (unbiased_std + eps)
    torch.testing.assert_close(group_advantages(REWARDS, "batch", eps=eps), expected)


def test_group_advantages_default_is_group_with_eps_1e4():
    torch.testing.assert_close(group_advantages(REWARDS), group_advantages(REWARDS, "group", 1e-4))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_all_equal_group_gives_zero_advantages(scale):
    rewards = torch.tensor([[3.0, 3.0, 3.0], [0.0, 1.0, 2.0]])
    advantages = group_advantages(rewards, scale)
    assert torch.equal(advantages[0], torch.zeros(3))
    assert not torch.isnan(advantages).any()


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_of_one_gives_zeros(scale):
    advantages = group_advantages(torch.tensor([[1.0], [5.0]]), scale)
    assert torch.equal(advantages, torch.zeros(2, 1))


def test_group_advantages_unknown_scale():
    with pytest.raises(ValueError, match=r"scale_rewards must be one of .*'group'.*got 'std'"):
        group_advantages(REWARDS, "std")


def test_group_advantages_rejects_nan_and_names_position():
    rewards = torch.tensor([[1.0, 0.0], [NAN, 1.0]])
    with pytest.raises(ValueError, match=r"NaN at \(question, completion\) \[\(1, 0\)\]"):
        group_advantages(rewards)


def test_group_advantages_rejects_flat_rewards():
    with pytest.raises(ValueError, match=r"rewards must be \(questions, group_size\)"):
        group_advantages(torch.zeros(8))


# ---------------------------------------------------------------- reward_stats


def test_reward_stats_hand_computed():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 2.0], [2.0, 2.0, 2.0], [0.0, 0.0, 3.0]])
    stats = reward_stats(rewards)
    assert stats["reward"] == pytest.approx(15 / 12)
    # group stds (unbiased): 0, 1, 0, sqrt(3)
    assert stats["reward_std"] == pytest.approx((0 + 1 + 0 + math.sqrt(3)) / 4)
    assert stats["frac_reward_zero_std"] == pytest.approx(0.5)
    assert set(stats) == {"reward", "reward_std", "frac_reward_zero_std"}


def test_normalized_reward_sum_is_trls_normalize_then_sum():
    """Against TRL 1.16's own lines (GRPOTrainer._generate_and_score_completions), NaN entries
    included: a function that does not apply to a completion, or to all but one of a group."""
    trl_utils = pytest.importorskip("trl.trainer.utils")
    from cppo.algorithm import normalized_reward_sum
    g = torch.Generator().manual_seed(0)
    per_function = torch.randint(0, 4, (3, 4, 2), generator=g).float()
    per_function[0, 1, 0] = float("nan")
    per_function[2, 1:, 1] = float("nan")
    weights = torch.tensor([1.0, 0.5])
    grouped = per_function
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = trl_utils.nanstd(grouped, dim=1, keepdim=True)
    trl = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, 2)
    trl = (trl * weights.unsqueeze(0)).nansum(dim=1).view(3, 4)
    torch.testing.assert_close(normalized_reward_sum(per_function, weights), trl)


# ---------------------------------------------------------------- mutation work (#54)


def test_recompute_on_kept_refuses_a_nan_reward_it_keeps():
    from cppo.algorithm import recompute_advantages_on_kept
    rewards = torch.tensor([[1.0, NAN, 0.0]], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"^rewards of kept completions must not be NaN$"):
        recompute_advantages_on_kept(rewards, torch.tensor([[True, True, False]]))
    # a pruned NaN is ignored
    got = recompute_advantages_on_kept(rewards, torch.tensor([[True, False, True]]), "none")
    assert got.tolist() == [[0.5, 0.0, -0.5]]


def test_recompute_on_kept_batch_scale_with_two_kept_divides_by_their_std():
    from cppo.algorithm import recompute_advantages_on_kept
    eps = 1e-4
    rewards = torch.tensor([[1.0, 3.0, 9.0, 9.0]], dtype=torch.float64)
    got = recompute_advantages_on_kept(rewards, torch.tensor([[True, True, False, False]]), "batch", eps)
    # kept 1 and 3: mean 2, unbiased std of {1, 3} = sqrt(2)
    assert got.tolist() == [[-1.0 / (math.sqrt(2.0) + eps), 1.0 / (math.sqrt(2.0) + eps), 0.0, 0.0]]


def test_normalized_reward_sum_has_the_rewards_dtype_whatever_the_weights():
    from cppo.algorithm import normalized_reward_sum
    per_function = torch.tensor([[[0.0, 1.0], [2.0, 3.0]]], dtype=torch.float32)
    weights = torch.tensor([1.0, 0.5], dtype=torch.float64)
    got = normalized_reward_sum(per_function, weights, eps=0.0)
    # each function over the group of 2: (r - mean) / std = -1/sqrt(2), +1/sqrt(2); weights 1, 0.5
    assert got.dtype == torch.float32
    value = 1.5 / math.sqrt(2.0)
    torch.testing.assert_close(got, torch.tensor([[-value, value]]), rtol=1e-6, atol=0.0)


def test_reward_stats_batch_scale_is_the_std_of_all_rewards():
    rewards = torch.tensor([[0.0, 2.0], [4.0, 6.0]], dtype=torch.float64)
    stats = reward_stats(rewards, "batch")
    # mean 3; squared deviations 9 + 1 + 1 + 9 = 20 over n - 1 = 3
    assert stats == {"reward": 3.0, "reward_std": pytest.approx(math.sqrt(20 / 3), rel=1e-12),
                     "frac_reward_zero_std": 0.0}
    assert type(stats["frac_reward_zero_std"]) is float and type(stats["reward_std"]) is float


@pytest.mark.parametrize("rewards, zero", [
    ([[1.0, 1.0], [1.0, 1.0]], 1.0),    # std 0
    ([[5.0]], 1.0),                     # one reward: std 0 (not NaN)
    ([[0.0, 2e-9]], 1.0),               # std sqrt(2) 1e-9 < 1e-8: counts as zero
    ([[0.0, 2e-8]], 0.0),               # std sqrt(2) 1e-8 > 1e-8
])
def test_reward_stats_batch_zero_std_is_the_whole_batch(rewards, zero):
    stats = reward_stats(torch.tensor(rewards, dtype=torch.float64), "batch")
    assert stats["frac_reward_zero_std"] == zero
    if len(rewards[0]) == 1:
        assert stats == {"reward": 5.0, "reward_std": 0.0, "frac_reward_zero_std": 1.0}


@pytest.mark.parametrize("scale", ["group", "none"])
def test_reward_stats_group_scale_averages_the_group_stds(scale):
    rewards = torch.tensor([[0.0, 2.0], [4.0, 4.0], [1.0, 7.0], [3.0, 5.0]], dtype=torch.float64)
    stats = reward_stats(rewards, scale)
    # unbiased stds sqrt(2), 0, sqrt(18) = 3 sqrt(2), sqrt(2): mean 5 sqrt(2) / 4; one group of 4 equal
    assert stats["reward"] == 3.25
    assert stats["reward_std"] == pytest.approx(5 * math.sqrt(2.0) / 4, rel=1e-12)
    assert stats["frac_reward_zero_std"] == 0.25
    assert reward_stats(rewards) == stats   # group is the default


def test_reward_stats_groups_of_one_have_zero_std():
    rewards = torch.tensor([[1.0], [4.0]], dtype=torch.float64)
    stats = reward_stats(rewards)
    assert stats == {"reward": 2.5, "reward_std": 0.0, "frac_reward_zero_std": 1.0}
    torch.set_default_device("meta")   # the zeros are made on the rewards' device
    try:
        assert reward_stats(rewards) == stats
    finally:
        torch.set_default_device(None)


@pytest.mark.parametrize("scale", ["group", "batch"])
def test_reward_stats_of_no_rewards_are_nan(scale):
    stats = reward_stats(torch.zeros(0, 4), scale)
    assert set(stats) == {"reward", "reward_std", "frac_reward_zero_std"}
    assert all(math.isnan(v) for v in stats.values())


def test_reward_stats_check_the_rewards():
    with pytest.raises(ValueError, match=r"^rewards must be \(questions, group_size\), got shape \(4,\); "
                                         r"reshape flat rewards with rewards.view\(-1, group_size\)$"):
        reward_stats(torch.zeros(4))
    rewards = torch.zeros(2, 3)
    rewards[1, 2] = NAN
    with pytest.raises(ValueError, match=r"^rewards are NaN at \(question, completion\) \[\(1, 2\)\]: no "
                                         r"reward function applied to these completions; every "
                                         r"completion needs a reward$"):
        reward_stats(rewards)


def test_nan_positions_are_listed_up_to_ten():
    rewards = torch.full((1, 11), NAN)
    shown = ", ".join(f"(0, {i})" for i in range(10))
    with pytest.raises(ValueError, match=rf"^rewards are NaN at \(question, completion\) \[{re.escape(shown)}\] \.\.\.: "):
        group_advantages(rewards)
    rewards = torch.full((1, 10), NAN)
    shown = ", ".join(f"(0, {i})" for i in range(10))
    with pytest.raises(ValueError, match=rf"^rewards are NaN at \(question, completion\) \[{re.escape(shown)}\]: "):
        group_advantages(rewards)


@pytest.mark.parametrize("scale", ["group", "none", "batch"])
def test_an_all_equal_group_is_exactly_zero_beside_a_varied_one(scale):
    # three 0.1 in float64: r - mean leaves a residue of ~1e-17 that std + eps would blow up
    rewards = torch.tensor([[0.1, 0.1, 0.1], [0.0, 1.0, 2.0]], dtype=torch.float64)
    advantages = group_advantages(rewards, scale)
    assert advantages[0].tolist() == [0.0, 0.0, 0.0]
    assert advantages[1, 1].item() == 0.0 and advantages[1, 0].item() < 0 < advantages[1, 2].item()


def test_combine_rewards_weights_take_the_rewards_dtype():
    per_function = torch.tensor([[3.0, 1.0]], dtype=torch.float64)
    # 0.1 as a float64 weight, not float32's 0.100000001490116
    assert combine_rewards(per_function, [0.1, 1.0]).tolist() == [3.0 * 0.1 + 1.0]
    got = combine_rewards(per_function.float(), torch.tensor([0.5, 2.0], dtype=torch.float64))
    assert got.dtype == torch.float32 and got.tolist() == [3.5]


def test_combine_rewards_weights_are_made_on_the_rewards_device():
    per_function = torch.tensor([[3.0, NAN], [1.0, 2.0]], dtype=torch.float64)
    torch.set_default_device("meta")
    try:
        default = combine_rewards(per_function)
        listed = combine_rewards(per_function, [2.0, 0.5])
    finally:
        torch.set_default_device(None)
    assert default.tolist() == [3.0, 3.0] and listed.tolist() == [6.0, 3.0]
