"""selection_rule unbiased (cppo.algorithm.inclusion): inclusion probabilities from |A| (floor,
iterative capping), a systematic draw of exactly num_keep completions, and the weights that make
the kept completions' policy gradient an unbiased estimate of the unpruned one.

Monte-Carlo bounds: an empirical frequency of n draws is within 5 sqrt(pi (1 - pi) / n) of pi;
a mean of n draws of an estimator is within 5 (its sample standard deviation) / sqrt(n) of its
expectation, per coordinate (+1e-12 where an estimator does not vary). The seeds are fixed, so
each test gives the same answer every run; the estimators that drop the weights (or keep the
largest |A|) are required to miss by more than 30 such bounds.
"""

import math

import pytest
import torch

from cppo.algorithm import LOSS_TYPES, Objective, per_token_policy_loss, reduce_loss
from cppo.algorithm.inclusion import (CAP_TOLERANCE, capped_probabilities, design_rows,
                                      inclusion_probabilities, inclusion_weights, keep_by_inclusion,
                                      systematic_sample)
from cppo.algorithm.loss import TOKEN_NORMALISED_LOSSES
from cppo.algorithm import selection
from cppo.algorithm.selection import (RULE_TRAITS, register_rule, round_inclusion_weights,
                                      round_keep_mask, rule_traits, select_completions)
from cppo.config import CPPOConfig
from helpers import make_trainer

D = torch.float64
RULE = "unbiased"
# Q = 3 questions x G = 6: distinct |A|, a tie (|-0.4| = |0.4|), zeros and one all-zero question
ADVANTAGES = torch.tensor([[2.0, -1.5, 0.4, -0.4, 0.0, 0.1],
                           [-3.0, 0.2, 0.9, 1.7, -0.6, 0.8],
                           [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]], dtype=D)
KEEP = {"question": 9, "step": 7}   # 3 per question; 7 of the 18 over the step
SIGMAS = 5.0


def t(values):
    return torch.tensor(values, dtype=D)


def draws(advantages, *, num_keep, scope, n, seed):
    """(n, Q, G) bool: n independent draws of the rule's design (systematic_sample on n copies
    of the design's rows, as keep_by_inclusion draws one)."""
    pi = inclusion_probabilities(advantages, num_keep=num_keep, scope=scope)
    rows = design_rows(pi, scope)
    return systematic_sample(rows.repeat(n, 1), torch.Generator().manual_seed(seed)).view(
        n, *advantages.shape)


def mean_and_bound(samples):
    """The mean over dim 0 and SIGMAS standard errors of it (per coordinate)."""
    n = samples.shape[0]
    return samples.mean(0), SIGMAS * samples.std(0) / math.sqrt(n) + 1e-12


# ---------------------------------------------------------------- the probabilities


def test_probabilities_by_hand_floor_and_iterative_capping():
    # |A| 2, 1, 0, 1 (mean 1): s = 2.1, 1.1, 0.1, 1.1 (sum 4.4); keep 2: pi = 2 s / 4.4
    pi = inclusion_probabilities(t([[2.0, -1.0, 0.0, 1.0]]), num_keep=2, scope="question")
    torch.testing.assert_close(pi, t([[21 / 22, 1 / 2, 1 / 22, 1 / 2]]), rtol=1e-14, atol=0)
    # 100 and 50 both exceed 1, the second only once the first is capped: 1, 1, then the four
    # equal ones share the last unit
    pi = inclusion_probabilities(t([[100.0, -50.0, 0.1, 0.1, -0.1, 0.1]]), num_keep=3, scope="step")
    torch.testing.assert_close(pi, t([[1.0, 1.0, 0.25, 0.25, 0.25, 0.25]]), rtol=1e-14, atol=0)
    # a huge |A| alone: pi = 1, the rest in proportion to their scores (sum 1)
    pi = inclusion_probabilities(t([[1e6, 1.0, 2.0, 0.0]]), num_keep=2, scope="step")
    scores = t([1.0, 2.0, 0.0]) + 0.1 * (1e6 + 3.0) / 4
    torch.testing.assert_close(pi, t([[1.0, *(scores / scores.sum()).tolist()]]), rtol=1e-12, atol=0)
    # all |A| 0: uniform; keep all: every pi 1; keep none: every pi 0
    zeros = torch.zeros(2, 4, dtype=D)
    assert inclusion_probabilities(zeros, num_keep=4, scope="question").tolist() == [[0.5] * 4] * 2
    assert inclusion_probabilities(ADVANTAGES, num_keep=18, scope="step").eq(1).all()
    assert inclusion_probabilities(ADVANTAGES, num_keep=0, scope="question").eq(0).all()
    with pytest.raises(ValueError, match="floor must be > 0"):
        inclusion_probabilities(ADVANTAGES, num_keep=3, scope="question", floor=0.0)


@pytest.mark.parametrize("scope", ["question", "step"])
def test_probabilities_sum_to_num_keep_lie_in_0_1_and_grow_with_abs_advantage(scope):
    generator = torch.Generator().manual_seed(0)
    advantages = torch.cat([ADVANTAGES, torch.randn(2, 6, generator=generator, dtype=D) ** 3])
    advantages[3, 2] = 40.0   # capped
    num_keep = {"question": 15, "step": 11}[scope]
    pi = inclusion_probabilities(advantages, num_keep=num_keep, scope=scope)
    assert ((pi > 0) & (pi <= 1)).all()
    assert pi[3, 2] == 1.0
    rows, sizes = design_rows(pi, scope), design_rows(advantages.abs(), scope)
    keep = num_keep // 5 if scope == "question" else num_keep
    torch.testing.assert_close(rows.sum(1), torch.full((rows.shape[0],), float(keep), dtype=D),
                               rtol=0, atol=1e-12)
    for p, size in zip(rows, sizes):
        order = torch.argsort(size)
        assert (p[order].diff() >= -1e-15).all()             # monotone in |A|
        assert ((size[order].diff() == 0) <= (p[order].diff() == 0)).all()   # equal |A|, equal pi


def test_probabilities_edge_cases_per_question_mean_and_capping_to_the_end():
    # no completions: an empty float64 (0, G); one completion kept: pi 1 (weight 1)
    empty = inclusion_probabilities(torch.zeros(0, 4, dtype=D), num_keep=0, scope="question")
    assert empty.dtype == D and empty.shape == (0, 4)
    assert inclusion_probabilities(t([[0.7]]), num_keep=1, scope="step").tolist() == [[1.0]]
    assert inclusion_weights(t([[0.7]]), num_keep=1, scope="step").tolist() == [[1.0]]
    # float32 advantages: computed (and returned) in float64
    pi = inclusion_probabilities(ADVANTAGES.float(), num_keep=7, scope="step")
    assert pi.dtype == D
    torch.testing.assert_close(pi, inclusion_probabilities(ADVANTAGES.float().double(), num_keep=7,
                                                           scope="step"), rtol=1e-15, atol=0)
    # the floor is 0.1 of each question's own mean |A|: row 1 mean 1, row 2 mean 0.1
    pi = inclusion_probabilities(t([[2.0, 0.0], [0.2, 0.0]]), num_keep=2, scope="question")
    torch.testing.assert_close(pi, t([[21 / 22, 1 / 22], [21 / 22, 1 / 22]]), rtol=1e-14, atol=0)
    # 'question' scope: num_keep // Q per question
    pi = inclusion_probabilities(ADVANTAGES, num_keep=10, scope="question")
    torch.testing.assert_close(pi.sum(1), t([3.0, 3.0, 3.0]), rtol=0, atol=1e-12)
    # capping one unit a round until every unit is capped (N rounds, then one that caps none)
    assert inclusion_probabilities(t([[100.0, 1.0, 0.0]]), num_keep=3, scope="step").eq(1).all()
    # the cap threshold is inclusive: c * s = 1 - CAP_TOLERANCE exactly counts as capped
    c = 1.0 - CAP_TOLERANCE
    assert capped_probabilities(t([[c, 1.0 - c]]), 1).tolist() == [[1.0, 0.0]]


# ---------------------------------------------------------------- the draw


@pytest.mark.parametrize("scope", ["question", "step"])
def test_inclusion_frequencies_match_pi_and_every_draw_keeps_num_keep(scope):
    n = 20_000
    masks = draws(ADVANTAGES, num_keep=KEEP[scope], scope=scope, n=n, seed=1)
    if scope == "question":
        assert masks.sum(2).eq(KEEP[scope] // 3).all()
    assert masks.sum((1, 2)).eq(KEEP[scope]).all()
    pi = inclusion_probabilities(ADVANTAGES, num_keep=KEEP[scope], scope=scope)
    frequency = masks.to(D).mean(0)
    assert ((frequency - pi).abs() <= SIGMAS * (pi * (1 - pi) / n).sqrt() + 1e-12).all()
    # the bound can tell: uniform frequencies would be far outside it
    uniform = torch.full_like(pi, KEEP[scope] / 18)
    assert ((uniform - pi).abs() > 30 * SIGMAS * (pi * (1 - pi) / n).sqrt()).any()


@pytest.mark.parametrize("scope", ["question", "step"])
def test_the_rule_draws_what_the_design_draws(scope):
    """select_completions(rule='unbiased') is one draw of the design (the helper above), keeps
    exactly num_keep (num_keep // Q per question), and its frequencies over 2,000 seeded draws
    are within the bound."""
    generator = torch.Generator().manual_seed(5)
    state = generator.get_state()
    mask = select_completions(ADVANTAGES, ADVANTAGES, num_keep=KEEP[scope], scope=scope, rule=RULE,
                              generator=generator)
    replay = torch.Generator()
    replay.set_state(state)
    pi = inclusion_probabilities(ADVANTAGES, num_keep=KEEP[scope], scope=scope)
    assert torch.equal(mask, systematic_sample(design_rows(pi, scope), replay).view(3, 6))
    n, total = 2_000, torch.zeros(3, 6, dtype=D)
    for _ in range(n):
        mask = select_completions(ADVANTAGES, ADVANTAGES, num_keep=KEEP[scope], scope=scope,
                                  rule=RULE, generator=generator)
        assert int(mask.sum()) == KEEP[scope]
        if scope == "question":
            assert mask.sum(1).tolist() == [3, 3, 3]
        total += mask
    assert ((total / n - pi).abs() <= SIGMAS * (pi * (1 - pi) / n).sqrt() + 1e-12).all()


def test_every_pair_can_be_kept_together():
    """The random order before the systematic draw: with it every pair of completions of a design
    (none capped, at least 2 drawn) is kept together in some draw; a fixed order never keeps
    neighbours whose probabilities sum to 1 together (units 0 and 1 of pi = 1/2, 1/2, 1/2, 1/2)."""
    for advantages, num_keep in ((torch.zeros(1, 4, dtype=D), 2),
                                 (t([[0.3, -0.5, 0.8, 0.2], [-0.6, 0.1, 0.0, 0.4]]), 3)):
        assert (inclusion_probabilities(advantages, num_keep=num_keep, scope="step") < 1).all()
        masks = draws(advantages, num_keep=num_keep, scope="step", n=20_000, seed=8).flatten(1).to(D)
        together = masks.T @ masks   # (units, units): how many draws keep both
        assert (together > 0).all()


def test_same_seed_same_mask_other_seeds_other_masks_global_generator_untouched():
    def mask(seed):
        return keep_by_inclusion(ADVANTAGES, ADVANTAGES, num_keep=7, scope="step",
                                 generator=torch.Generator().manual_seed(seed))
    before = torch.get_rng_state()
    assert torch.equal(mask(3), mask(3))
    assert torch.equal(torch.get_rng_state(), before)
    assert len({tuple(mask(seed).flatten().tolist()) for seed in range(6)}) > 1
    assert not torch.equal(mask(3), mask(4))


def test_the_sampler_keeps_sure_units_and_never_draws_zero_ones():
    pi = t([[1.0, 0.0, 0.5, 0.5, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]])
    drawn = systematic_sample(pi.repeat(500, 1), torch.Generator().manual_seed(0)).view(500, 2, 6)
    assert drawn[:, pi == 1].all() and not drawn[:, pi == 0].any()
    assert drawn.sum(2).eq(3).all()


def scripted_rand(monkeypatch, *values):
    """torch.rand returns these float64 tensors in turn (systematic_sample: the order's keys, then
    U), each of the shape asked for."""
    queue = [t(v) for v in values]

    def rand(size, *args, **kwargs):
        value = queue.pop(0)
        assert tuple(value.shape) == tuple(size)
        return value
    monkeypatch.setattr(torch, "rand", rand)


def test_a_point_on_an_interval_end_falls_in_the_next_unit(monkeypatch):
    """Intervals are [start, end): U = 0 never draws a pi = 0 unit (laid first, empty), and a
    point exactly on an end belongs to the next unit."""
    pi = t([[0.0, 0.5, 0.5]])
    scripted_rand(monkeypatch, [[0.5, 0.1, 0.2]], [[0.0]])
    assert systematic_sample(pi, None).tolist() == [[False, True, False]]
    scripted_rand(monkeypatch, [[0.5, 0.1, 0.2]], [[0.5]])
    assert systematic_sample(pi, None).tolist() == [[False, False, True]]


def test_sure_units_stay_out_of_the_draw(monkeypatch):
    """pi = 1 units are kept outright, not laid in the line: a point just below an interval's end
    stays in it (were the sure unit's length-1 interval laid first, U + 1 would round onto 1.4)."""
    pi = t([[1.0, 0.4, 0.6]])
    scripted_rand(monkeypatch, [[0.0, 0.1, 0.2]], [[math.nextafter(0.4, 0.0)]])
    assert systematic_sample(pi, None).tolist() == [[True, True, False]]


def test_zero_units_are_laid_first_so_a_rounding_overshoot_never_draws_one(monkeypatch):
    """Ten units of 0.1 end at 0.9999999999999999: U at that end falls past the last interval and
    goes to the last unit, which must be one with pi > 0 (the pi = 0 unit, whose key is the
    largest, is laid first)."""
    pi = t([[0.1] * 10 + [0.0]])
    scripted_rand(monkeypatch, [[i / 100 for i in range(10)] + [0.99]], [[0.9999999999999999]])
    drawn = systematic_sample(pi, None)
    assert drawn.sum() == 1 and not drawn[0, 10] and drawn[0, 9]


def test_float32_probabilities_are_laid_end_to_end_in_float64(monkeypatch):
    """0.1f + 0.2f ends at 0.30000000447 in float64 (0.30000001192 in float32 arithmetic): a
    point at 0.30000001 lies past it, in the third unit."""
    pi = torch.tensor([[0.1, 0.2, 0.7]], dtype=torch.float32)
    scripted_rand(monkeypatch, [[0.1, 0.2, 0.3]], [[0.30000001]])
    assert systematic_sample(pi, None).tolist() == [[False, False, True]]


def test_the_draw_is_the_systematic_draw_of_the_generators_float64_numbers():
    """Replayed by hand: keys (R, N) then U (R, 1), both float64 uniforms from the generator; the
    units with 0 < pi < 1 laid end to end by key, kept where one of U, U + 1, ... falls."""
    generator = torch.Generator().manual_seed(11)
    advantages = torch.randn(40, 6, generator=generator, dtype=D)
    pi = inclusion_probabilities(advantages, num_keep=40 * 3, scope="question")
    state = generator.get_state()
    drawn = systematic_sample(pi, generator)
    replay = torch.Generator()
    replay.set_state(state)
    keys = torch.rand(pi.shape, generator=replay, dtype=D).tolist()
    starts = torch.rand((40, 1), generator=replay, dtype=D).tolist()
    for row, key, (u,), mask in zip(pi.tolist(), keys, starts, drawn.tolist()):
        rest = [p if p < 1 else 0.0 for p in row]
        count, end, expected = round(sum(rest)), 0.0, [p >= 1 for p in row]
        for i in sorted(range(6), key=lambda i: key[i] + (rest[i] > 0)):
            start, end = end, end + rest[i]
            expected[i] |= any(start <= u + k < end for k in range(count))
        assert mask == expected


def test_a_unit_drawn_twice_is_an_error():
    """Probabilities that do not sum to an integer (1.5: two points over a line of length 1.5)
    put two points on one unit: refused, not a silent draw."""
    pi = t([[0.9, 0.6]]).repeat(200, 1)
    with pytest.raises(RuntimeError, match="^systematic_sample: a unit was drawn twice "
                                           r"\(probabilities above 1\?\)$"):
        systematic_sample(pi, torch.Generator().manual_seed(0))


def test_without_a_generator_float32_probabilities_and_no_rows():
    pi = t([[0.5, 0.25, 0.75, 0.5, 0.0, 1.0]]).repeat(50, 1)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        assert systematic_sample(pi, None).sum(1).eq(3).all()
        mask = keep_by_inclusion(ADVANTAGES, ADVANTAGES, num_keep=7, scope="step", generator=None)
        assert int(mask.sum()) == 7
    # float32 probabilities: drawn in float64, the same draw as the float64 ones (exact values)
    assert torch.equal(systematic_sample(pi.float(), torch.Generator().manual_seed(3)),
                       systematic_sample(pi, torch.Generator().manual_seed(3)))
    assert systematic_sample(torch.zeros(0, 4, dtype=D), torch.Generator()).shape == (0, 4)


# ---------------------------------------------------------------- the weights: unbiased gradients


def gradient_estimates(masks, weights, gradients, num_keep):
    """(n, dims) per draw: (1 / num_keep) sum over the kept completions of w_i g_i."""
    return torch.einsum("nq,q,qd->nd", masks.flatten(1).to(D), weights.flatten(), gradients) / num_keep


@pytest.mark.parametrize("scope", ["question", "step"])
def test_weighted_kept_gradient_is_unbiased_and_unweighted_is_not(scope):
    num_keep = KEEP[scope]
    # per-completion gradients as a policy term's: A_i times a random direction, plus a part
    # every completion has (as a KL term's)
    generator = torch.Generator().manual_seed(2)
    gradients = ADVANTAGES.flatten()[:, None] * torch.randn(18, 5, generator=generator, dtype=D) \
        + 0.3 * torch.randn(18, 5, generator=generator, dtype=D)
    full = gradients.mean(0)                        # (1 / N) sum over all completions
    masks = draws(ADVANTAGES, num_keep=num_keep, scope=scope, n=20_000, seed=3)
    weights = inclusion_weights(ADVANTAGES, num_keep=num_keep, scope=scope)
    pi = inclusion_probabilities(ADVANTAGES, num_keep=num_keep, scope=scope)
    torch.testing.assert_close(weights, num_keep / (18 * pi), rtol=1e-14, atol=0)
    mean, bound = mean_and_bound(gradient_estimates(masks, weights, gradients, num_keep))
    assert ((mean - full).abs() <= bound).all()
    # without the weights (w = 1), and keeping the largest |A|: far outside the bound
    plain = gradient_estimates(masks, torch.ones_like(weights), gradients, num_keep).mean(0)
    assert ((plain - full).abs() / bound).max() > 30
    largest = select_completions(ADVANTAGES, ADVANTAGES, num_keep=num_keep, scope=scope)
    biased = gradient_estimates(largest[None], torch.ones_like(weights), gradients, num_keep)[0]
    assert ((biased - full).abs() / bound).max() > 30


def test_weights_take_the_floor_and_are_zero_where_pi_is_zero():
    weights = inclusion_weights(ADVANTAGES, num_keep=7, scope="step", floor=0.5)
    pi = inclusion_probabilities(ADVANTAGES, num_keep=7, scope="step", floor=0.5)
    torch.testing.assert_close(weights, 7 / (18 * pi), rtol=1e-14, atol=0)
    assert not torch.allclose(weights, inclusion_weights(ADVANTAGES, num_keep=7, scope="step"))
    # nothing kept: every pi 0, every weight 0 (not kept_share / tiny)
    assert inclusion_weights(ADVANTAGES, num_keep=0, scope="step", kept_share=0.5).eq(0).all()


def per_draw_loss_gradients(loss_type, masks, advantages, logps, old_logps, completion_mask, *,
                            num_keep, scope, weighting="rule"):
    """(n, N, T): for each draw, the gradient w.r.t. the log-probs of the loss (per_token_policy_loss
    + reduce_loss) on the kept completions only, advantages times the rule's weights: weighting
    'rule' with the kept share of the loss's normaliser (tokens for token-normalised losses),
    'sequences' with the kept share of completions whatever the loss, 'none' without weights.
    All draws' kept rows go through one per_token_policy_loss call (its rows are independent),
    each draw's through its own reduce_loss; each draw has its own copy of the log-probs."""
    n, (rows, width) = masks.shape[0], logps.shape
    leaf = logps.detach().expand(n, rows, width).clone().requires_grad_()
    draw, kept = masks.flatten(1).nonzero(as_tuple=True)   # draw-major: num_keep rows per draw
    tokens = completion_mask.sum(1)
    weights = inclusion_weights(advantages, num_keep=num_keep, scope=scope).flatten()[kept]
    if loss_type in TOKEN_NORMALISED_LOSSES and weighting == "rule":
        shares = tokens[kept].view(n, num_keep).sum(1) / tokens.sum()   # (n,) kept / all tokens
        weights = inclusion_weights(advantages, num_keep=num_keep, scope=scope,
                                    kept_share=1.0).flatten()[kept] * shares[draw]
    factor = 1.0 if weighting == "none" else weights
    per_token, _ = per_token_policy_loss(
        leaf[draw, kept], old_logps[kept], advantages.flatten()[kept] * factor,
        Objective(epsilon_low=0.2, epsilon_high=0.28, loss_type=loss_type),
        completion_mask=completion_mask[kept])
    mask = completion_mask[kept]
    total = sum(reduce_loss(per_token[d * num_keep:(d + 1) * num_keep],
                            mask[d * num_keep:(d + 1) * num_keep], loss_type,
                            max_completion_length=width) for d in range(n))
    total.backward()
    return leaf.grad


def loss_problem(seed=4):
    """The 18 completions of ADVANTAGES: log-probs (18, 5), old ones off by up to +-0.4 (so some
    ratios are clipped), lengths 1..5."""
    generator = torch.Generator().manual_seed(seed)
    logps = -torch.rand(18, 5, generator=generator, dtype=D) * 3
    old_logps = logps + (torch.rand(18, 5, generator=generator, dtype=D) - 0.5) * 0.8
    lengths = torch.randint(1, 6, (18,), generator=generator)
    mask = (torch.arange(5)[None] < lengths[:, None]).to(D)
    return logps, old_logps, mask


def full_loss_gradient(loss_type, advantages, logps, old_logps, mask):
    logps = logps.detach().clone().requires_grad_()
    objective = Objective(epsilon_low=0.2, epsilon_high=0.28, loss_type=loss_type)
    per_token, stats = per_token_policy_loss(logps, old_logps, advantages.flatten(), objective,
                                             completion_mask=mask)
    reduce_loss(per_token, mask, loss_type, max_completion_length=5).backward()
    return logps.grad, stats


@pytest.mark.parametrize("loss_type, scope", [(loss, "step") for loss in LOSS_TYPES]
                         + [("grpo", "question"), ("dapo", "question")])
def test_loss_gradient_through_the_real_loss_is_unbiased(loss_type, scope):
    """The kept completions' loss gradient (advantages times the weights), averaged over 1,500
    draws, equals the unpruned loss's within the bound, for every loss type (token-normalised
    ones with the token share); without the weights (grpo, dapo) it does not."""
    logps, old_logps, mask = loss_problem()
    full, stats = full_loss_gradient(loss_type, ADVANTAGES, logps, old_logps, mask)
    if loss_type == "grpo":
        assert stats["is_region_clipped"][mask.bool()].any()   # the clip is in play
    masks = draws(ADVANTAGES, num_keep=KEEP[scope], scope=scope, n=1_500, seed=6)
    grads = per_draw_loss_gradients(loss_type, masks, ADVANTAGES, logps, old_logps, mask,
                                    num_keep=KEEP[scope], scope=scope)
    mean, bound = mean_and_bound(grads)
    assert ((mean - full).abs() <= bound).all(), float(((mean - full).abs() / bound).max())
    if loss_type in ("grpo", "dapo"):
        plain = per_draw_loss_gradients(loss_type, masks, ADVANTAGES, logps, old_logps, mask,
                                        num_keep=KEEP[scope], scope=scope, weighting="none")
        assert ((plain.mean(0) - full).abs() / bound).max() > 30


def test_dapo_with_the_sequence_share_is_not_unbiased():
    """Why token-normalised losses take the token share: with w = K / (N pi) instead, the dapo
    gradient misses (the kept completions' token count varies with the draw)."""
    logps, old_logps, mask = loss_problem()
    full, _ = full_loss_gradient("dapo", ADVANTAGES, logps, old_logps, mask)
    masks = draws(ADVANTAGES, num_keep=7, scope="step", n=1_500, seed=6)
    right = per_draw_loss_gradients("dapo", masks, ADVANTAGES, logps, old_logps, mask,
                                    num_keep=7, scope="step")
    sequences = per_draw_loss_gradients("dapo", masks, ADVANTAGES, logps, old_logps, mask,
                                        num_keep=7, scope="step", weighting="sequences")
    mean, bound = mean_and_bound(right)
    assert ((mean - full).abs() <= bound).all()
    assert ((sequences.mean(0) - full).abs() / bound).max() > 30


def test_token_normalised_losses_are_those_reduce_loss_divides_by_tokens():
    per_token = t([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])   # the second completion adds nothing but tokens
    short, long = t([[1, 0, 0], [1, 0, 0]]), t([[1, 0, 0], [1, 1, 1]])
    by_tokens = {loss for loss in LOSS_TYPES
                 if reduce_loss(per_token, short, loss, max_completion_length=3)
                 != reduce_loss(per_token, long, loss, max_completion_length=3)}
    assert by_tokens == set(TOKEN_NORMALISED_LOSSES)


# ---------------------------------------------------------------- traits, scopes, global


def test_traits_and_config():
    assert rule_traits(RULE).reweights is True and rule_traits(RULE).scopes == ("question", "step")
    assert not any(traits.reweights for name, traits in RULE_TRAITS.items() if name != RULE)
    for scope in ("question", "step", "global"):
        cfg = CPPOConfig(selection_rule=RULE, selection_scope=scope, pruning_rate=0.5)
        assert cfg.selection_rule == RULE


def test_global_scope_is_one_design_over_every_process():
    mine = ADVANTAGES[:2]
    other = t([[0.5, -1.0, 2.0, 0.0, 0.3, 0.1], [-0.2, 0.0, 0.0, 4.0, 1.0, -1.0]])
    both = torch.cat([mine, other])
    gather = lambda x: torch.cat([x, other])   # noqa: E731  rank 0 of 2
    weights = round_inclusion_weights(mine, num_keep=5, scope="global", world_size=2, gather=gather)
    torch.testing.assert_close(weights, inclusion_weights(both, num_keep=10, scope="step")[:2])
    kwargs = dict(num_keep=5, rule=RULE, scope="global", rank=1, world_size=2)
    rows = round_keep_mask(other, other, generator=torch.Generator().manual_seed(1),
                           gather=lambda x: torch.cat([mine, x]), **kwargs)
    whole = select_completions(both, both, num_keep=10, scope="step", rule=RULE,
                               generator=torch.Generator().manual_seed(1))
    assert torch.equal(rows, whole[2:])
    # one process: the step scope's weights
    torch.testing.assert_close(round_inclusion_weights(mine, num_keep=4, scope="global"),
                               inclusion_weights(mine, num_keep=4, scope="step"))


def test_global_weights_are_each_ranks_slice_with_the_given_kept_share():
    mine = ADVANTAGES[:2]
    other = t([[0.5, -1.0, 2.0, 0.0, 0.3, 0.1], [-0.2, 0.0, 0.0, 4.0, 1.0, -1.0]])
    both = torch.cat([mine, other])
    whole = inclusion_weights(both, num_keep=10, scope="step", kept_share=0.3)
    for rank, own, gather in ((0, mine, lambda x: torch.cat([x, other])),
                              (1, other, lambda x: torch.cat([mine, x]))):
        weights = round_inclusion_weights(own, num_keep=5, scope="global", kept_share=0.3,
                                          rank=rank, world_size=2, gather=gather)
        torch.testing.assert_close(weights, whole[2 * rank:2 * rank + 2], rtol=1e-15, atol=0)


def test_register_rule_passes_its_traits_and_does_not_reweight_by_default(monkeypatch):
    monkeypatch.setattr(selection, "SELECTION_RULES", dict(selection.SELECTION_RULES))
    monkeypatch.setattr(selection, "RULE_TRAITS", dict(selection.RULE_TRAITS))
    register_rule("plain_test_rule")(selection.keep_random)
    register_rule("weighted_test_rule", scopes=("step",), reweights=True)(selection.keep_random)
    assert selection.rule_traits("plain_test_rule").reweights is False
    assert selection.rule_traits("weighted_test_rule") == selection.RuleTraits(("step",), False, True)
    assert selection.rule_traits("weighted_test_rule").reweights is True


# ---------------------------------------------------------------- in the trainer


def table_reward(prompts, completions, completion_ids=None, **columns):
    """Distinct rewards by position for a round's 4 x 4 completions; 0 for other calls."""
    if len(completions) != 16:
        return [0.0] * len(completions)
    return [float((7 * i) % 16) / 4 for i in range(16)]


@pytest.mark.parametrize("scope, loss_type", [("step", "dapo"), ("question", "grpo")])
def test_the_trainer_keeps_the_plan_and_weights_the_kept_advantages(tiny_model_dir, tmp_path,
                                                                    monkeypatch, scope, loss_type):
    import cppo.trainer
    trainer = make_trainer(tiny_model_dir, tmp_path / "run", reward=table_reward, max_steps=1,
                           selection_rule=RULE, selection_scope=scope, loss_type=loss_type,
                           scale_rewards="none", mask_truncated_completions=True)
    seen = {}
    select = trainer.select

    def recording_select(advantages, rewards):
        seen["advantages"] = advantages.clone()
        return select(advantages, rewards)

    def recording_kept_batch(prompts, completions, advantages, keep_mask, **kwargs):
        batch = kept_batch(prompts, completions, advantages, keep_mask, **kwargs)
        seen.update(completions=completions, keep_mask=keep_mask.clone(), batch=batch)
        return batch
    kept_batch = cppo.trainer.kept_batch
    trainer.select = recording_select
    monkeypatch.setattr(cppo.trainer, "kept_batch", recording_kept_batch)
    trainer.training_round()
    advantages, keep, batch = seen["advantages"], seen["keep_mask"], seen["batch"]
    plan = trainer.plan
    assert int(keep.sum()) == plan.completions_kept == 8 and len(batch) == 8
    if scope == "question":
        assert keep.sum(1).tolist() == [2, 2, 2, 2]
    pi = inclusion_probabilities(advantages.double(), num_keep=8, scope=scope)
    share = 8 / 16
    if loss_type == "dapo":   # kept / all loss tokens (truncated completions count none)
        completions = seen["completions"]
        tokens = (completions.mask * (~completions.truncated)[:, None]).sum(1).double()
        share = float(batch.loss_mask.sum()) / float(tokens.sum())
        assert share != 8 / 16
    expected = (advantages.double() * share / pi)[keep]
    torch.testing.assert_close(batch.advantages.double(), expected, rtol=1e-6, atol=1e-7)
    assert not torch.allclose(batch.advantages.double(), advantages.double()[keep])
