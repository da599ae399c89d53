"""The two-stage draw's rules (cppo.algorithm.two_stage) and zero-variance skipping's
(cppo.algorithm.skipping), exact integers and booleans, no model."""

import torch

from cppo.algorithm.allocation import plan_step
from cppo.algorithm.skipping import keep_probability, updated_streaks, zero_variance_groups
from cppo.algorithm.two_stage import balanced_continued, completions_to_keep, continued_questions


def test_completions_to_keep_at_the_rate_now_in_the_plans_scope():
    step = plan_step(completions_per_update=8, group_size=4, pruning_rate=0.5, allocation=True,
                     scope="step")
    question = plan_step(completions_per_update=8, group_size=4, pruning_rate=0.5,
                         allocation=True, scope="question")
    # 3 groups of 4 at P = 0.625: over the step round(12 x 0.375 = 4.5) = 5; per question
    # round(4 x 0.375 = 1.5) = 2 each, 6
    assert completions_to_keep(step, 3, 4, pruning_rate=0.625) == 5
    assert completions_to_keep(question, 3, 4, pruning_rate=0.625) == 6
    # the rate now applies even when every planned group is there
    assert completions_to_keep(step, 4, 4, pruning_rate=0.75) == 4
    assert completions_to_keep(step, 4, 4) == 8


def test_continued_questions_compare_the_draws_strictly_below_exploration():
    rewards = torch.tensor([[1.0, 1.0], [2.0, 2.0], [0.0, 1.0]])
    draws = torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64)
    assert continued_questions(rewards, draws, 0.25).tolist() == [False, False, True]
    assert continued_questions(rewards, draws, 0.5).tolist() == [True, False, True]


def test_continued_questions_on_the_rewards_device():
    rewards = torch.tensor([[1.0, 1.0], [0.0, 1.0]])
    draws = torch.tensor([0.0, 0.9], dtype=torch.float64)
    torch.set_default_device("meta")
    try:
        got = continued_questions(rewards, draws, 0.5)
    finally:
        torch.set_default_device(None)
    assert got.tolist() == [True, True]


def test_balanced_continued_fills_each_process_up_to_the_most():
    keep = torch.tensor([[True, True, True, False], [False, True, False, False],
                         [True, True, True, False]])
    draws = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.4, 0.0, 0.3, 0.1], [0.0, 0.0, 0.0, 0.9]],
                         dtype=torch.float64)
    out = balanced_continued(keep, draws)
    # K = 3: process 1 adds its two dropped questions of lowest draws (3: 0.1, then 2: 0.3)
    assert out.tolist() == [[True, True, True, False], [False, True, True, True],
                            [True, True, True, False]]
    assert keep.tolist()[1] == [False, True, False, False]   # the input is left alone


def test_skipping_rules_by_hand():
    rewards = torch.tensor([[2.0, 2.0], [0.0, 2.0], [2.0, 0.0]])
    assert zero_variance_groups(rewards).tolist() == [True, False, False]
    streaks = updated_streaks(torch.tensor([4, 4, 0]), torch.tensor([True, False, False]))
    assert streaks.tolist() == [5, 0, 0] and streaks.dtype == torch.long
    probs = keep_probability(torch.tensor([0, 3, 10]), floor=0.0)
    assert probs.tolist() == [1.0, 0.125, 2.0 ** -10] and probs.dtype == torch.float64
    assert keep_probability(torch.tensor([2, 3]), floor=0.25).tolist() == [0.25, 0.25]


def test_continued_questions_move_the_draws_to_the_rewards_device():
    # draws made on the CPU (the seeded generator's), rewards elsewhere (meta stands for a GPU)
    got = continued_questions(torch.zeros(2, 2, device="meta"), torch.tensor([0.1, 0.9]), 0.5)
    assert got.device.type == "meta" and got.shape == (2,)
