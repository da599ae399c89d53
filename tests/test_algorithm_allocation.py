import pytest

from cppo.algorithm import StepShape, plan_step


def plan(b, g, p, allocation=True, scope="step"):
    return plan_step(completions_per_update=b, group_size=g, pruning_rate=p, allocation=allocation, scope=scope)


# The CPPO paper's GSM8K table: 16 completions per update, G = 16.
PAPER_TABLE = [
    # P,      questions/step, scored, kept
    (0.0, 1, 16, 16),
    (0.5, 2, 32, 16),
    (0.75, 4, 64, 16),
    (0.875, 8, 128, 16),
    (0.9375, 16, 256, 16),
]


@pytest.mark.parametrize("pruning_rate, questions, scored, kept", PAPER_TABLE)
def test_paper_table_step_scope(pruning_rate, questions, scored, kept):
    shape = plan(16, 16, pruning_rate, allocation=True, scope="step")
    assert (shape.questions_per_step, shape.completions_scored, shape.completions_kept) == (questions, scored, kept)
    assert shape.keep_per_question is None
    assert shape.effective_pruning_rate == pytest.approx(pruning_rate)
    assert shape.group_size == 16
    # optimizer steps per epoch on 7,473 GSM8K questions (x mu = 2), as in the paper
    # (the paper floors: 7,473 // Q * 2)
    assert 7473 // shape.questions_per_step * 2 == {1: 14946, 2: 7472, 4: 3736, 8: 1868, 16: 934}[questions]


@pytest.mark.parametrize("pruning_rate, questions, scored, kept", PAPER_TABLE)
def test_paper_table_question_scope(pruning_rate, questions, scored, kept):
    shape = plan(16, 16, pruning_rate, allocation=True, scope="question")
    assert (shape.questions_per_step, shape.completions_scored, shape.completions_kept) == (questions, scored, kept)
    assert shape.keep_per_question == 16 // questions
    assert shape.questions_per_step * shape.keep_per_question == shape.completions_kept


@pytest.mark.parametrize(
    "pruning_rate, questions, effective",
    [
        (0.8, 5, 1 - 16 / 80),  # 16 / (16 * 0.2) = 5 exactly, despite float noise in 1 - 0.8
        (0.7, 4, 0.75),  # 16 / 4.8 = 3.33 -> 4
        (0.3, 2, 0.5),  # 16 / 11.2 = 1.43 -> 2
        (0.9, 10, 0.9),  # 16 / 1.6 = 10 exactly
    ],
)
def test_non_integer_pruning_rates_step_scope(pruning_rate, questions, effective):
    shape = plan(16, 16, pruning_rate, allocation=True, scope="step")
    assert shape.questions_per_step == questions
    assert shape.completions_scored == questions * 16
    assert shape.completions_kept == 16
    assert shape.effective_pruning_rate == pytest.approx(effective)
    assert shape.effective_pruning_rate >= pruning_rate - 1e-12


def test_allocation_step_scope_batch_need_not_divide_group():
    shape = plan(8, 16, 0.5, allocation=True, scope="step")
    assert (shape.questions_per_step, shape.completions_scored, shape.completions_kept) == (1, 16, 8)


def test_allocation_question_scope_non_integer_rate():
    # G (1 - 0.7) = 4.8 -> keep 5 per question; 20 completions per update -> 4 questions
    shape = plan(20, 16, 0.7, allocation=True, scope="question")
    assert shape == StepShape(questions_per_step=4, completions_scored=64, completions_kept=20, keep_per_question=5)


def test_allocation_question_scope_indivisible_batch_names_both_numbers():
    with pytest.raises(ValueError, match=r"completions_per_update=16 must be divisible by keep_per_question=5"):
        plan(16, 16, 0.7, allocation=True, scope="question")


def test_pruning_only_step_scope_rounds():
    # 16 * (1 - 0.7) = 4.8 -> 5 ; 32 * (1 - 0.8) = 6.4 -> 6 ; 16 * 0.5 = 8
    assert plan(16, 16, 0.7, allocation=False, scope="step") == StepShape(1, 16, 5, None)
    assert plan(32, 8, 0.8, allocation=False, scope="step") == StepShape(4, 32, 6, None)
    assert plan(16, 16, 0.5, allocation=False, scope="step") == StepShape(1, 16, 8, None)


def test_pruning_only_keeps_at_least_one():
    assert plan(4, 4, 0.99, allocation=False, scope="step").completions_kept == 1
    shape = plan(8, 4, 0.99, allocation=False, scope="question")
    assert (shape.keep_per_question, shape.completions_kept) == (1, 2)


def test_pruning_only_question_scope():
    # G = 8, P = 0.7: 8 * 0.3 = 2.4 -> 2 per question, 4 questions
    assert plan(32, 8, 0.7, allocation=False, scope="question") == StepShape(4, 32, 8, 2)


def test_rounding_is_half_up():
    # 4 * (1 - 0.375) = 2.5 -> 3 (not banker's 2); 10 * (1 - 0.75) = 2.5 -> 3
    assert plan(8, 4, 0.375, allocation=False, scope="question").keep_per_question == 3
    assert plan(10, 10, 0.75, allocation=False, scope="step").completions_kept == 3
    # 5 * (1 - 0.1) = 4.5 in decimal, 4.4999... in binary -> still 5
    assert plan(10, 5, 0.1, allocation=False, scope="question").keep_per_question == 5


@pytest.mark.parametrize("allocation", [False, True])
@pytest.mark.parametrize("scope", ["step", "question"])
def test_zero_pruning_is_plain_grpo(allocation, scope):
    shape = plan(32, 8, 0.0, allocation=allocation, scope=scope)
    assert (shape.questions_per_step, shape.completions_scored, shape.completions_kept) == (4, 32, 32)
    assert shape.effective_pruning_rate == 0.0
    assert shape.keep_per_question == (8 if scope == "question" else None)


def test_group_of_one_allowed_without_pruning():
    assert plan(4, 1, 0.0) == StepShape(4, 4, 4, None)


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5, float("nan")])
def test_pruning_rate_out_of_range(bad):
    with pytest.raises(ValueError, match=r"pruning rate P must lie in \[0, 1\).*got"):
        plan(16, 16, bad)


def test_group_size_below_two_with_pruning():
    with pytest.raises(ValueError, match=r"P = 0.5\) needs groups of G >= 2.*got G = 1"):
        plan(16, 1, 0.5)


@pytest.mark.parametrize("bad", [0, -4])
def test_batch_below_one(bad):
    with pytest.raises(ValueError, match=rf"completions_per_update must be an int >= 1, got {bad}"):
        plan(bad, 4, 0.5)


@pytest.mark.parametrize("allocation, scope, p", [(False, "step", 0.5), (False, "question", 0.5), (True, "step", 0.0)])
def test_batch_not_divisible_by_group(allocation, scope, p):
    with pytest.raises(ValueError, match=r"completions_per_update=10 must be divisible by group_size=4"):
        plan(10, 4, p, allocation=allocation, scope=scope)


def test_unknown_scope():
    with pytest.raises(ValueError, match=r"scope must be one of \('question', 'step'\), got 'device'"):
        plan(16, 16, 0.5, scope="device")


def test_step_shape_is_frozen():
    shape = plan(16, 16, 0.5)
    with pytest.raises(AttributeError):
        shape.questions_per_step = 3


# ---------------------------------------------------------------- mutation work (#54)

from cppo.algorithm.allocation import (check_pruning, completions_kept,  # noqa: E402
                                       questions_per_chunk, total_steps)


@pytest.mark.parametrize("max_steps, rows, per_round, epochs, steps_per_round, steps", [
    (7, 10, 4, 2.0, 3, 7),      # max_steps > 0 wins
    (1, 10, 4, 2.0, 3, 1),
    (0, 10, 4, 2.0, 3, 18),     # ceil(10 / 4) = 3 rounds an epoch, x 2 epochs x 3 steps
    (-1, 10, 4, 2.0, 3, 18),
    (0, 8, 4, 1.0, 1, 2),       # rows a multiple of the round: no partial round
    (0, 10, 4, 0.5, 2, 2),      # int(3 x 0.5) = 1 round x 2 steps
    (0, 10, 4, 0.1, 2, 1),      # int(0.3) = 0 rounds: at least one step
])
def test_total_steps(max_steps, rows, per_round, epochs, steps_per_round, steps):
    assert total_steps(max_steps, rows, per_round, epochs, steps_per_round) == steps


@pytest.mark.parametrize("chunk, group, questions, expected", [
    (None, 4, 6, 6),   # no chunking: every question at once
    (8, 4, 6, 2),
    (10, 4, 6, 2),     # whole groups, rounded down
    (3, 4, 6, 1),      # at least one question
    (4, 4, 6, 1),
])
def test_questions_per_chunk(chunk, group, questions, expected):
    assert questions_per_chunk(chunk, group, questions) == expected


@pytest.mark.parametrize("questions, group, p, question_scope, kept", [
    (3, 4, 0.5, True, 6),      # 3 x round(4 x 0.5)
    (3, 4, 0.5, False, 6),     # round(12 x 0.5)
    (3, 4, 0.625, True, 6),    # 4 x 0.375 = 1.5 -> 2 a question
    (3, 4, 0.625, False, 5),   # 12 x 0.375 = 4.5 -> 5 over the step
    (3, 4, 0.9, True, 3),      # at least one a question
    (3, 4, 0.99, False, 1),    # at least one over the step
    (2, 4, 0.0, False, 8),
])
def test_completions_kept(questions, group, p, question_scope, kept):
    assert completions_kept(questions, group, p, question_scope=question_scope) == kept


def test_step_shape_group_size_and_effective_rate():
    shape = plan(16, 16, 0.5)
    assert shape.group_size == 16 and shape.effective_pruning_rate == 0.5
    assert type(shape.group_size) is int
    assert StepShape(3, 12, 3, None).group_size == 4
    assert StepShape(3, 12, 3, None).effective_pruning_rate == 0.75


@pytest.mark.parametrize("bad", [True, 2.0, "4", 0, -1])
def test_group_size_must_be_an_int_of_at_least_one(bad):
    with pytest.raises(ValueError, match=rf"^group_size must be an int >= 1, got {bad!r}$"):
        plan(16, bad, 0.0)


@pytest.mark.parametrize("bad", [True, 16.0])
def test_completions_per_update_must_be_an_int(bad):
    with pytest.raises(ValueError, match=rf"^completions_per_update must be an int >= 1, got {bad!r}$"):
        plan(bad, 4, 0.0)


def test_check_pruning_messages_and_bounds():
    check_pruning(0.0, 1)    # no pruning: a group of one is fine
    check_pruning(0, 1)
    check_pruning(0.5, 2)
    for bad in ("0.5", None, 1, -0.0001):
        with pytest.raises(ValueError, match=r"^the pruning rate P must lie in \[0, 1\) \(1 would "
                                             r"prune every completion\), got "):
            check_pruning(bad, 4)
    with pytest.raises(ValueError, match=r"^pruning \(P = 0.25\) needs groups of G >= 2 completions "
                                         r"per question \(the advantages of a group of one are all "
                                         r"0\), got G = 1$"):
        check_pruning(0.25, 1)


def test_allocation_keeps_float_noise_out_of_the_counts():
    # 16 / (16 x (1 - 0.8)) = 5.000000000000001 in binary: 5 questions, not 6
    shape = plan(16, 16, 0.8)
    assert (shape.questions_per_step, shape.completions_scored, shape.completions_kept) == (5, 80, 16)
    # G (1 - P) = 10 x (1 - 0.65) = 3.5: half up to 4 (keep_per_question)
    assert plan(8, 10, 0.65, allocation=True, scope="question").keep_per_question == 4


def test_allocation_question_scope_counts():
    shape = plan(12, 8, 0.5, allocation=True, scope="question")
    assert shape == StepShape(3, 24, 12, 4)
    shape = plan(16, 8, 0.5, allocation=False, scope="question")
    assert shape == StepShape(2, 16, 8, 4)
    shape = plan(16, 8, 0.5, allocation=False, scope="step")
    assert shape == StepShape(2, 16, 8, None)


@pytest.mark.parametrize("allocation, scope, p", [(False, "step", 0.0), (False, "question", 0.5),
                                                  (True, "question", 0.5), (True, "step", 0.5)])
def test_counts_are_ints(allocation, scope, p):
    shape = plan(16, 8, p, allocation=allocation, scope=scope)
    for value in (shape.questions_per_step, shape.completions_scored, shape.completions_kept,
                  shape.group_size):
        assert type(value) is int


def test_one_completion_per_update_is_allowed():
    assert plan(1, 1, 0.0) == StepShape(1, 1, 1, None)
    assert plan(1, 2, 0.5) == StepShape(1, 2, 1, None)


def test_allocation_question_scope_error_says_what_to_change():
    with pytest.raises(ValueError, match=r"^completions_per_update=10 must be divisible by keep_per_question=4 "
                                         r"\(= 8 \* \(1 - 0.5\) rounded half up\) for allocation with "
                                         r"scope='question'; change the batch or the pruning rate, or "
                                         r"use scope='step'$"):
        plan(10, 8, 0.5, allocation=True, scope="question")


@pytest.mark.parametrize("count, parts, sizes", [
    (5, 2, [3, 2]), (6, 3, [2, 2, 2]), (1, 3, [1, 0, 0]), (7, 4, [2, 2, 2, 1]), (0, 2, [0, 0]),
])
def test_even_blocks_cut_the_items_in_order_with_the_extra_ones_first(count, parts, sizes):
    """Generators share a round's groups in contiguous ranges that cover every item once, in
    order, their sizes differing by at most one, the first ranges taking the extra items."""
    from cppo.algorithm.allocation import even_blocks
    blocks = even_blocks(count, parts)
    assert [len(b) for b in blocks] == sizes
    assert [i for b in blocks for i in b] == list(range(count))
