import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cppo.algorithm import (
    SELECTION_RULES,
    group_advantages,
    keep_highest_scores,
    recompute_advantages_on_kept,
    register_rule,
    rule_traits,
    select_completions,
)
from cppo.algorithm.selection import keep_random


def mask_of(rows):
    return torch.tensor(rows, dtype=torch.bool)


def kept_positions(mask):
    return [tuple(p) for p in mask.nonzero().tolist()]


ADVANTAGES = torch.tensor([[0.5, -2.0, 1.0, 0.0], [3.0, -3.0, 0.1, -0.2]])
REWARDS = torch.zeros_like(ADVANTAGES)


# ---------------------------------------------------------------- largest_abs / smallest_abs


def test_largest_abs_question_scope():
    mask = select_completions(ADVANTAGES, REWARDS, num_keep=4, scope="question", rule="largest_abs")
    assert torch.equal(mask, mask_of([[0, 1, 1, 0], [1, 1, 0, 0]]))


def test_largest_abs_step_scope_lets_a_question_keep_zero_or_all():
    mask = select_completions(ADVANTAGES, REWARDS, num_keep=3, scope="step", rule="largest_abs")
    assert torch.equal(mask, mask_of([[0, 1, 0, 0], [1, 1, 0, 0]]))
    advantages = torch.tensor([[0.1, 0.2, 0.0], [5.0, -4.0, 3.0]])
    mask = select_completions(advantages, torch.zeros(2, 3), num_keep=3, scope="step")
    assert torch.equal(mask, mask_of([[0, 0, 0], [1, 1, 1]]))


def test_largest_abs_is_the_default_rule():
    default = select_completions(ADVANTAGES, REWARDS, num_keep=3, scope="step")
    explicit = select_completions(ADVANTAGES, REWARDS, num_keep=3, scope="step", rule="largest_abs")
    assert torch.equal(default, explicit)


def test_smallest_abs_question_scope():
    mask = select_completions(ADVANTAGES, REWARDS, num_keep=4, scope="question", rule="smallest_abs")
    assert torch.equal(mask, mask_of([[1, 0, 0, 1], [0, 0, 1, 1]]))


def test_smallest_abs_step_scope():
    mask = select_completions(ADVANTAGES, REWARDS, num_keep=3, scope="step", rule="smallest_abs")
    # |A| sorted ascending: 0 (0,3), 0.1 (1,2), 0.2 (1,3), 0.5 (0,0) ...
    assert kept_positions(mask) == [(0, 3), (1, 2), (1, 3)]


def test_all_equal_groups_are_pruned_first_under_largest_abs():
    rewards = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    advantages = group_advantages(rewards)
    mask = select_completions(advantages, rewards, num_keep=4, scope="step")
    assert torch.equal(mask, mask_of([[0, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]))


# ---------------------------------------------------------------- tie-breaking


@pytest.mark.parametrize("rule", ["largest_abs", "smallest_abs"])
def test_ties_step_scope_lower_flat_index_wins(rule):
    advantages = torch.tensor([[1.0, -1.0, 1.0], [-1.0, 1.0, -1.0]])  # all |A| equal
    mask = select_completions(advantages, torch.zeros(2, 3), num_keep=4, scope="step", rule=rule)
    # question-major flat order: (0,0) (0,1) (0,2) (1,0) ...
    assert kept_positions(mask) == [(0, 0), (0, 1), (0, 2), (1, 0)]


@pytest.mark.parametrize("rule", ["largest_abs", "smallest_abs"])
def test_ties_question_scope_lower_completion_index_wins(rule):
    advantages = torch.tensor([[2.0, 1.0, -1.0, 1.0, -2.0], [0.5, 0.5, 0.5, 0.5, 0.5]])
    mask = select_completions(advantages, torch.zeros(2, 5), num_keep=6, scope="question", rule=rule)
    if rule == "largest_abs":
        # question 0: |2| at 0 and 4, then the first |1| at 1
        assert torch.equal(mask, mask_of([[1, 1, 0, 0, 1], [1, 1, 1, 0, 0]]))
    else:
        # question 0: the three |1| at 1, 2, 3
        assert torch.equal(mask, mask_of([[0, 1, 1, 1, 0], [1, 1, 1, 0, 0]]))


def test_ties_break_the_same_way_on_long_rows():
    # long rows, where unstable sorts (and topk) are known to reorder equal keys
    advantages = torch.tensor([[1.0, -1.0] * 200, [0.0] * 400])
    mask = select_completions(advantages, torch.zeros(2, 400), num_keep=250, scope="step")
    expected = torch.zeros(2, 400, dtype=torch.bool)
    expected[0, :250] = True
    assert torch.equal(mask, expected)
    again = select_completions(advantages.clone(), torch.zeros(2, 400), num_keep=250, scope="step")
    assert torch.equal(mask, again)

    per_question = select_completions(advantages, torch.zeros(2, 400), num_keep=300, scope="question")
    expected = torch.zeros(2, 400, dtype=torch.bool)
    expected[:, :150] = True
    assert torch.equal(per_question, expected)


# ---------------------------------------------------------------- random


def test_random_rule_reproducible_with_seed_and_differs_across_seeds():
    advantages = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))

    def pick(seed, scope):
        return select_completions(
            advantages, advantages, num_keep=16, scope=scope, rule="random",
            generator=torch.Generator().manual_seed(seed),
        )

    for scope in ("step", "question"):
        assert torch.equal(pick(1, scope), pick(1, scope))
        assert not torch.equal(pick(1, scope), pick(2, scope))


def test_random_rule_ignores_advantages_and_is_roughly_uniform():
    generator = torch.Generator().manual_seed(123)
    advantages = torch.tensor([[10.0, 0.0, 0.0, 0.0]])
    counts = torch.zeros(1, 4)
    draws = 400
    for _ in range(draws):
        counts += select_completions(
            advantages, advantages, num_keep=2, scope="question", rule="random", generator=generator
        )
    frequency = counts / draws
    assert torch.all((frequency - 0.5).abs() < 0.1), frequency


# ---------------------------------------------------------------- max_variance (PODS)


def test_max_variance_binary_rewards_keeps_both_extremes():
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0, 1.0, 1.0]])
    mask = select_completions(torch.zeros_like(rewards), rewards, num_keep=2, scope="question", rule="max_variance")
    # i = 1: the last of the ascending order (index 5) + the first (index 0)
    assert torch.equal(mask, mask_of([[1, 0, 0, 0, 0, 1]]))


def test_max_variance_hand_example():
    rewards = torch.tensor([[5.0, 1.0, 9.0, 3.0, 7.0, 2.0]])
    # ascending: 1 2 3 5 7 9. Candidates for m = 3: {1,2,3} {1,2,9} (var 38/3) {1,7,9} (var 104/9) {5,7,9}
    mask = select_completions(torch.zeros_like(rewards), rewards, num_keep=3, scope="question", rule="max_variance")
    assert torch.equal(mask, mask_of([[0, 1, 1, 0, 0, 1]]))  # rewards 1, 9, 2


def test_max_variance_equal_variances_take_fewest_highest():
    # ascending 0 1 2 3 10 11; {0,1,11} and {0,10,11} both have variance 74/3: the smallest i (1) wins
    rewards = torch.tensor([[10.0, 0.0, 11.0, 1.0, 2.0, 3.0]])
    mask = select_completions(torch.zeros_like(rewards), rewards, num_keep=3, scope="question", rule="max_variance")
    assert torch.equal(mask, mask_of([[0, 1, 1, 1, 0, 0]]))


def test_max_variance_works_per_question():
    rewards = torch.tensor([[0.0, 1.0, 0.5, 0.2], [4.0, 4.0, 4.0, 4.0]])
    mask = select_completions(torch.zeros_like(rewards), rewards, num_keep=4, scope="question", rule="max_variance")
    assert torch.equal(mask[0], torch.tensor([True, True, False, False]))
    # all equal: variance 0 for every i, so i = 0: the first two of the (stable) ascending order
    assert torch.equal(mask[1], torch.tensor([True, True, False, False]))


def test_max_variance_rejects_step_scope():
    rewards = torch.rand(2, 4)
    with pytest.raises(ValueError, match=r"'max_variance' needs scope in \('question',\), got scope='step'"):
        select_completions(rewards, rewards, num_keep=4, scope="step", rule="max_variance")


def brute_force_max_variance(values, keep):
    return max(
        torch.tensor([values[i] for i in subset], dtype=torch.float64).var(unbiased=False).item()
        for subset in itertools.combinations(range(len(values)), keep)
    )


@settings(max_examples=150, deadline=None)
@given(
    rewards=st.lists(
        st.one_of(st.integers(0, 3).map(float), st.floats(-5, 5, allow_nan=False, width=32)),
        min_size=6,
        max_size=6,
    ),
    keep=st.integers(1, 6),
)
def test_max_variance_matches_brute_force(rewards, keep):
    rewards_tensor = torch.tensor([rewards], dtype=torch.float64)
    mask = select_completions(
        torch.zeros_like(rewards_tensor), rewards_tensor, num_keep=keep, scope="question", rule="max_variance"
    )
    assert int(mask.sum()) == keep
    chosen_variance = rewards_tensor[mask].var(unbiased=False).item()
    assert chosen_variance == pytest.approx(brute_force_max_variance(rewards, keep), rel=1e-9, abs=1e-12)


# ---------------------------------------------------------------- every rule x scope: exact counts


# every registered rule, in each scope it declares: a rule added later is tested here too
RULE_SCOPES = [(rule, scope) for rule in SELECTION_RULES for scope in rule_traits(rule).scopes]
DRAWING_RULES = {"random", "unbiased"}   # they draw from the generator passed in


@pytest.mark.parametrize("rule, scope", RULE_SCOPES)
@pytest.mark.parametrize("num_keep", [0, 3, 6, 12, 24])
def test_exact_number_kept(rule, scope, num_keep):
    generator = torch.Generator().manual_seed(7)
    rewards = torch.randint(0, 3, (3, 8), generator=generator).float()  # discrete: many ties
    advantages = group_advantages(rewards)
    state = generator.get_state()
    mask = select_completions(
        advantages, rewards, num_keep=num_keep, scope=scope, rule=rule, generator=generator
    )
    assert mask.dtype == torch.bool and mask.shape == (3, 8)
    assert int(mask.sum()) == num_keep
    if scope == "question":
        assert mask.sum(dim=1).tolist() == [num_keep // 3] * 3
    # the same again: a drawing rule from a generator in the same state, the others without one
    same = torch.Generator()
    same.set_state(state)
    again = select_completions(
        advantages, rewards, num_keep=num_keep, scope=scope, rule=rule,
        generator=same if rule in DRAWING_RULES else None,
    )
    assert torch.equal(mask, again)


# ---------------------------------------------------------------- validation and registry


def test_question_scope_needs_divisible_num_keep():
    with pytest.raises(ValueError, match=r"num_keep=5 must be divisible by the number of questions 2"):
        select_completions(ADVANTAGES, REWARDS, num_keep=5, scope="question")


def test_unknown_rule_lists_registered_ones():
    with pytest.raises(ValueError, match=r"unknown selection rule 'biggest'.*'largest_abs'.*'max_variance'"):
        select_completions(ADVANTAGES, REWARDS, num_keep=2, scope="step", rule="biggest")


def test_unknown_scope():
    with pytest.raises(ValueError, match=r"scope must be one of \('question', 'step'\), got 'global'"):
        select_completions(ADVANTAGES, REWARDS, num_keep=2, scope="global")


@pytest.mark.parametrize("bad", [-1, 9, 2.0])
def test_num_keep_out_of_range(bad):
    with pytest.raises(ValueError, match=r"num_keep must be an int in \[0, 8\]"):
        select_completions(ADVANTAGES, REWARDS, num_keep=bad, scope="step")


def test_shape_mismatch():
    with pytest.raises(ValueError, match=r"rewards shape \(2, 3\) must equal advantages shape \(2, 4\)"):
        select_completions(ADVANTAGES, torch.zeros(2, 3), num_keep=2, scope="step")


def test_register_rule_adds_a_rule_and_refuses_duplicates():
    @register_rule("keep_first_test_only")
    def keep_first(advantages, rewards, *, num_keep, scope, generator):
        mask = torch.zeros(advantages.numel(), dtype=torch.bool)
        mask[:num_keep] = True
        return mask.view(advantages.shape)

    try:
        mask = select_completions(ADVANTAGES, REWARDS, num_keep=3, scope="step", rule="keep_first_test_only")
        assert kept_positions(mask) == [(0, 0), (0, 1), (0, 2)]
        with pytest.raises(ValueError, match="already registered"):
            register_rule("keep_first_test_only")(keep_first)
    finally:
        del SELECTION_RULES["keep_first_test_only"]


def test_broken_rule_is_caught():
    @register_rule("broken_test_only")
    def keep_none(advantages, rewards, *, num_keep, scope, generator):
        return torch.zeros_like(advantages, dtype=torch.bool)

    try:
        with pytest.raises(RuntimeError, match=r"'broken_test_only' returned .* 0 kept; expected .* 3 kept"):
            select_completions(ADVANTAGES, REWARDS, num_keep=3, scope="step", rule="broken_test_only")
    finally:
        del SELECTION_RULES["broken_test_only"]


# ---------------------------------------------------------------- recompute_advantages_on_kept

RECOMPUTE_REWARDS = torch.tensor([[0.0, 1.0, 2.0, 3.0], [4.0, 4.0, 8.0, 0.0]], dtype=torch.float64)
RECOMPUTE_KEEP = mask_of([[1, 0, 1, 1], [1, 1, 0, 0]])


def test_recompute_on_kept_group_hand_computed():
    eps = 1e-4
    advantages = recompute_advantages_on_kept(RECOMPUTE_REWARDS, RECOMPUTE_KEEP, "group", eps)
    # question 0 keeps 0, 2, 3: mean 5/3, unbiased std sqrt(7/3); question 1 keeps 4, 4: all 0
    std = math.sqrt(7 / 3)
    expected = torch.tensor(
        [[(-5 / 3) / (std + eps), 0.0, (1 / 3) / (std + eps), (4 / 3) / (std + eps)], [0.0, 0.0, 0.0, 0.0]],
        dtype=torch.float64,
    )
    torch.testing.assert_close(advantages, expected)


def test_recompute_on_kept_none_and_batch():
    centered = torch.tensor([[-5 / 3, 0.0, 1 / 3, 4 / 3], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(recompute_advantages_on_kept(RECOMPUTE_REWARDS, RECOMPUTE_KEEP, "none"), centered)
    kept_values = [0.0, 2.0, 3.0, 4.0, 4.0]
    mean = sum(kept_values) / 5
    batch_std = math.sqrt(sum((v - mean) ** 2 for v in kept_values) / 4)
    torch.testing.assert_close(
        recompute_advantages_on_kept(RECOMPUTE_REWARDS, RECOMPUTE_KEEP, "batch", 1e-4),
        centered / (batch_std + 1e-4),
    )


def test_recompute_on_kept_with_full_mask_equals_group_advantages():
    rewards = torch.randn(3, 5, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    full = torch.ones(3, 5, dtype=torch.bool)
    for scale in ("group", "batch", "none"):
        torch.testing.assert_close(
            recompute_advantages_on_kept(rewards, full, scale), group_advantages(rewards, scale)
        )


def test_recompute_on_kept_zero_or_one_kept_and_nan_in_pruned():
    rewards = torch.tensor([[1.0, float("nan"), 3.0], [2.0, 5.0, float("nan")]])
    keep = mask_of([[0, 0, 0], [0, 1, 0]])
    advantages = recompute_advantages_on_kept(rewards, keep)
    assert torch.equal(advantages, torch.zeros(2, 3))


def test_recompute_on_kept_after_max_variance():
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0, 1.0, 1.0]])
    keep = select_completions(torch.zeros_like(rewards), rewards, num_keep=2, scope="question", rule="max_variance")
    advantages = recompute_advantages_on_kept(rewards, keep, "group", eps=0.0)
    # kept {0, 1}: mean 0.5, unbiased std sqrt(0.5) -> -/+ 0.5 / sqrt(0.5)
    expected = torch.tensor([[-math.sqrt(0.5), 0.0, 0.0, 0.0, 0.0, math.sqrt(0.5)]])
    torch.testing.assert_close(advantages, expected)


def test_recompute_on_kept_shape_mismatch():
    with pytest.raises(ValueError, match=r"rewards and keep_mask must both be"):
        recompute_advantages_on_kept(torch.zeros(2, 3), torch.ones(2, 4, dtype=torch.bool))


# ---------------------------------------------------------------- traits, devices, long rows (mutation work, #54)


def test_register_rule_traits_default_and_explicit():
    @register_rule("plain_test_only")
    def plain(advantages, rewards, *, num_keep, scope, generator):
        return keep_first_n(advantages, num_keep)

    @register_rule("pods_like_test_only", scopes=("question",), advantages_on_kept=True)
    def pods_like(advantages, rewards, *, num_keep, scope, generator):
        return keep_first_n(advantages, num_keep)

    try:
        assert rule_traits("plain_test_only").scopes == ("question", "step")
        assert rule_traits("plain_test_only").advantages_on_kept is False
        assert rule_traits("pods_like_test_only").scopes == ("question",)
        assert rule_traits("pods_like_test_only").advantages_on_kept is True
    finally:
        del SELECTION_RULES["plain_test_only"], SELECTION_RULES["pods_like_test_only"]
    assert rule_traits("max_variance").advantages_on_kept is True
    assert rule_traits("largest_abs").advantages_on_kept is False


def keep_first_n(advantages, num_keep):
    mask = torch.zeros(advantages.numel(), dtype=torch.bool)
    mask[:num_keep] = True
    return mask.view(advantages.shape)


@pytest.mark.parametrize("scopes", [("global",), ("step", "everywhere"), ()])
def test_register_rule_refuses_unknown_or_empty_scopes(scopes):
    with pytest.raises(ValueError, match=r"rule 'bad_scopes_test_only': scopes must be a non-empty "
                                         r"subset of \('question', 'step'\)"):
        register_rule("bad_scopes_test_only", scopes=scopes)
    assert "bad_scopes_test_only" not in SELECTION_RULES


def test_random_rule_without_generator_uses_the_global_one():
    advantages = torch.zeros(2, 4, dtype=torch.float64)
    torch.manual_seed(11)
    got = select_completions(advantages, advantages, num_keep=3, scope="step", rule="random")
    torch.manual_seed(11)
    scores = torch.rand(2, 4)
    expected = torch.zeros(8, dtype=torch.bool)
    expected[torch.sort(scores.flatten(), descending=True, stable=True).indices[:3]] = True
    assert torch.equal(got, expected.view(2, 4))


def test_rules_work_on_the_tensors_device_not_the_default_device():
    # a default device other than the tensors' (torch.set_default_device): the masks are made
    # on the tensors' device, the random scores on the generator's (then moved)
    rewards = torch.tensor([[0.0, 1.0, 2.0, 3.0]], dtype=torch.float64)
    torch.set_default_device("meta")
    try:
        seeded = select_completions(rewards, rewards, num_keep=2, scope="question", rule="random",
                                    generator=torch.Generator(device="cpu").manual_seed(5))
        pods = select_completions(rewards, rewards, num_keep=2, scope="question", rule="max_variance")
    finally:
        torch.set_default_device(None)
    scores = torch.rand(1, 4, generator=torch.Generator().manual_seed(5))
    assert torch.equal(seeded, keep_highest_scores(scores, num_keep=2, scope="question"))
    assert pods.tolist() == [[True, False, False, True]]


def test_random_rule_mask_is_on_the_advantages_device():
    advantages = torch.zeros(2, 3, device="meta")
    mask = keep_random(advantages, advantages, num_keep=2, scope="step",
                       generator=torch.Generator(device="cpu").manual_seed(0))
    assert mask.device.type == "meta" and mask.shape == (2, 3)


def test_max_variance_ties_on_long_rows_follow_the_stable_order():
    # 200 zeros (even indices) and 200 ones (odd): m = 100 keeps 50 + 50; among equal rewards the
    # stable ascending order keeps the lowest-index zeros and the highest-index ones
    rewards = torch.tensor([[0.0, 1.0] * 200], dtype=torch.float64)
    mask = select_completions(rewards, rewards, num_keep=100, scope="question", rule="max_variance")
    expected = torch.zeros(1, 400, dtype=torch.bool)
    expected[0, 0:100:2] = True
    expected[0, 301:400:2] = True
    assert torch.equal(mask, expected)


def test_step_scope_mask_is_made_on_the_scores_device():
    scores = torch.tensor([[0.5, 2.0], [1.0, 0.0]], dtype=torch.float64)
    torch.set_default_device("meta")
    try:
        mask = keep_highest_scores(scores, num_keep=2, scope="step")
    finally:
        torch.set_default_device(None)
    assert mask.tolist() == [[False, True], [True, False]]


@pytest.mark.parametrize("bad", [True, False])
def test_num_keep_bool_is_refused(bad):
    with pytest.raises(ValueError, match=r"num_keep must be an int in \[0, 8\] .*got (True|False)"):
        select_completions(ADVANTAGES, REWARDS, num_keep=bad, scope="step")


def test_flat_advantages_refused_with_their_shape():
    with pytest.raises(ValueError, match=r"advantages must be \(questions, group_size\), got shape \(4,\)"):
        select_completions(torch.zeros(4), torch.zeros(4), num_keep=2, scope="step")


def test_no_questions_keep_nothing_in_question_scope():
    mask = select_completions(torch.zeros(0, 4), torch.zeros(0, 4), num_keep=0, scope="question")
    assert mask.shape == (0, 4) and mask.dtype == torch.bool


def test_rule_put_into_the_registry_by_hand_has_default_traits():
    from cppo.algorithm.selection import RuleTraits
    SELECTION_RULES["by_hand_test_only"] = lambda *args, **kwargs: None
    try:
        traits = rule_traits("by_hand_test_only")
        assert traits == RuleTraits() and traits.scopes == ("question", "step")
        assert traits.advantages_on_kept is False
    finally:
        del SELECTION_RULES["by_hand_test_only"]
