import math

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
