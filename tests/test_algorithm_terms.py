"""Each term of the GRPO family's loss against values derived by hand, in float64 on tensors of a
few entries: the policy terms of every loss_type (clip with its two-sided delta, cispo, sapo,
vespo's gamma weight), the KL and its bias correction, the reductions, the entropy bonus, the
high-entropy and off-policy masks and the sampler's importance weights. These are the fast
witnesses of the behaviour (benchmarks/mutation.py runs its mutants against them); the TRL
differential (tests/test_trl_differential.py) is the second, slow one."""

import math

import pytest
import torch

from cppo.algorithm import (Objective, entropy_bonus, gamma_weights, high_entropy_mask,
                            importance_ratio, masked_mean, off_policy_mask, per_token_policy_loss,
                            reduce_loss, sampler_correction_stats, sampler_importance_weights)
from cppo.algorithm.loss import router_aux_coef, router_aux_loss

D = torch.float64
LN = math.log


def t(values):
    return torch.tensor(values, dtype=D)


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


# two sequences x three tokens; old log-probs 0, so the token ratios are exp(logps)
RATIOS = [[1.5, 0.5, 1.1], [1.5, 0.5, 0.9]]
LOGPS = [[LN(r) for r in row] for row in RATIOS]
ADV = [1.0, -0.5]


def loss_of(loss_type, logps=None, **fields):
    """The loss of LOGPS (or logps) under the objective's fields (eps 0.2 / 0.28 unless given)."""
    logps = t(LOGPS) if logps is None else logps
    fields.setdefault("epsilon_low", 0.2)
    fields.setdefault("epsilon_high", 0.28)
    return per_token_policy_loss(logps, torch.zeros_like(logps), t(ADV),
                                 Objective(loss_type=loss_type, **fields))


# ------------------------------------------------------------------------- policy terms


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "luspo"])
def test_clipped_term_by_hand(loss_type):
    # -min(r A, clip(r, 0.8, 1.28) A)
    expected = [[-1.28, -0.5, -1.1],           # A = 1: 1.5 clipped to 1.28; 0.5 below: unclipped
                [0.75, 0.4, 0.45]]             # A = -0.5: 1.5 unclipped; 0.5 clipped to 0.8
    loss, stats = loss_of(loss_type)
    torch.testing.assert_close(loss, t(expected))
    assert stats["is_high_clipped"].tolist() == [[True, False, False], [False, False, False]]
    assert stats["is_low_clipped"].tolist() == [[False, False, False], [False, True, False]]
    assert stats["is_region_clipped"].tolist() == [[True, False, False], [False, True, False]]


def test_clip_bounds_are_epsilon_low_and_epsilon_high_and_inclusive():
    # ratios exactly at 1 - eps_low and 1 + eps_high are not clipped
    logps = t([[LN(0.75), LN(1.25)], [LN(0.75), LN(1.25)]])
    loss, stats = per_token_policy_loss(logps, torch.zeros_like(logps), t([-1.0, 1.0]),
                                        Objective(epsilon_low=0.25, epsilon_high=0.25))
    torch.testing.assert_close(loss, t([[0.75, 1.25], [-0.75, -1.25]]))
    assert not stats["is_region_clipped"].any()


def test_delta_caps_the_unclipped_ratio():
    # two-sided clipping: rho' = min(rho, 1.3); A = -0.5 at rho 1.5: -min(-0.65, -0.64) = 0.65
    loss, _ = loss_of("grpo", delta=1.3)
    torch.testing.assert_close(loss, t([[-1.28, -0.5, -1.1], [0.65, 0.4, 0.45]]))


def test_cispo_term_and_its_gradient():
    logps = t(LOGPS).requires_grad_(True)
    loss, stats = loss_of("cispo", logps=logps, epsilon_high=1.2)
    weights = [[min(r, 1.2) for r in row] for row in RATIOS]
    expected = [[-w * a * lp for w, lp in zip(wr, lr)] for wr, lr, a in zip(weights, LOGPS, ADV)]
    torch.testing.assert_close(loss, t(expected))
    loss.sum().backward()   # the weight is detached: d/dlogp = -min(r, eps_high) A
    torch.testing.assert_close(logps.grad, t([[-w * a for w in wr] for wr, a in zip(weights, ADV)]))
    assert stats["is_high_clipped"].tolist() == [[True, False, False], [False, False, False]]
    assert not stats["is_low_clipped"].any()


def test_sapo_term_uses_the_temperature_of_the_advantages_sign():
    loss, _ = loss_of("sapo", sapo_temperature_pos=2.0, sapo_temperature_neg=0.5)
    expected = [[-sigmoid(2.0 * (r - 1)) * 4 / 2.0 * ADV[0] for r in RATIOS[0]],
                [-sigmoid(0.5 * (r - 1)) * 4 / 0.5 * ADV[1] for r in RATIOS[1]]]
    torch.testing.assert_close(loss, t(expected))
    # at rho = 1 the term is -2 A / tau, its gradient -A (sigmoid'(0) = 1/4, times 4)
    logps = torch.zeros(1, 1, dtype=D, requires_grad=True)
    sapo = Objective(epsilon_low=0.2, epsilon_high=0.2, loss_type="sapo", sapo_temperature_pos=2.0)
    term, _ = per_token_policy_loss(logps, logps.detach(), t([3.0]), sapo)
    term.sum().backward()
    assert term.item() == pytest.approx(-3.0) and logps.grad.item() == pytest.approx(-3.0)


def test_sapo_default_temperatures():
    loss, _ = loss_of("sapo")
    expected = [[-sigmoid(1.0 * (r - 1)) * 4 / 1.0 * ADV[0] for r in RATIOS[0]],
                [-sigmoid(1.05 * (r - 1)) * 4 / 1.05 * ADV[1] for r in RATIOS[1]]]
    torch.testing.assert_close(loss, t(expected))


def phi(log_w, positive, k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0):
    k, lam = (k_pos, lambda_pos) if positive else (k_neg, lambda_neg)
    return math.exp(lam + k * log_w - lam * math.exp(log_w))


def test_vespo_gamma_weights_by_hand():
    log_ratio = t([[0.1, -0.3, 0.5], [0.2, 0.1, 0.0], [0.4, 0.0, 0.0]])
    mask = t([[1, 1, 0], [1, 1, 1], [1, 1, 1]])
    advantages = t([[1.0], [-0.5], [0.0]])   # A = 0 takes the positive parameters
    weights = gamma_weights(advantages, log_ratio, mask)
    expected = [[phi(-0.2, True)], [phi(0.3, False)], [phi(0.4, True)]]
    torch.testing.assert_close(weights, t(expected))
    custom = gamma_weights(advantages, log_ratio, mask, k_pos=1.5, lambda_pos=0.5, k_neg=0.5,
                           lambda_neg=1.5)
    expected = [[phi(-0.2, True, 1.5, 0.5)], [phi(0.3, False, k_neg=0.5, lambda_neg=1.5)],
                [phi(0.4, True, 1.5, 0.5)]]
    torch.testing.assert_close(custom, t(expected))


def test_vespo_gamma_weights_keep_float64():
    """k and lambda are taken in the log-ratios' dtype: float64 weights are exact to float64
    rounding, also for parameters float32 cannot hold (0.1, 1.3)."""
    log_ratio = t([[0.1, -0.3, 0.5], [0.2, 0.1, 0.0]])
    mask = t([[1, 1, 0], [1, 1, 1]])
    advantages = t([[1.0], [-0.5]])
    weights = gamma_weights(advantages, log_ratio, mask, k_pos=1.3, lambda_pos=0.1, k_neg=0.7,
                            lambda_neg=2.9)
    assert weights.dtype == D
    expected = [[phi(-0.2, True, 1.3, 0.1)], [phi(0.3, False, k_neg=0.7, lambda_neg=2.9)]]
    torch.testing.assert_close(weights, t(expected), rtol=1e-13, atol=0.0)


def test_vespo_gamma_weights_clamps_and_sampling_weights():
    # token log-ratios clamp to [-20, 20]; log w to [log 1e-8, 20]; lambda to >= 1e-4
    # (rtol 1e-5: k and lambda are float32 scalars inside, lambda x e^10 carries their rounding)
    advantages = t([[1.0], [1.0], [1.0]])
    log_ratio = t([[25.0, -10.0], [-30.0, 0.0], [1.0, 0.0]])
    mask = torch.ones(3, 2, dtype=D)
    weights = gamma_weights(advantages, log_ratio, mask, k_pos=1.0, lambda_pos=1e-3)
    low = LN(1e-8)
    torch.testing.assert_close(weights[:2], t([[phi(10.0, True, 1.0, 1e-3)], [phi(low, True, 1.0, 1e-3)]]),
                               rtol=1e-5, atol=0)   # ~1e-8: no absolute tolerance
    # the lower token clamp: -25 counts as -20, so log w = -20 + 10
    below = gamma_weights(t([[1.0]]), t([[-25.0, 10.0]]), torch.ones(1, 2, dtype=D), k_pos=1.0,
                          lambda_pos=1e-3)
    torch.testing.assert_close(below, t([[phi(-10.0, True, 1.0, 1e-3)]]), rtol=1e-5, atol=0)
    zero_lambda = gamma_weights(advantages[2:], log_ratio[2:], mask[2:], k_pos=1.0, lambda_pos=0.0)
    torch.testing.assert_close(zero_lambda, t([[phi(1.0, True, 1.0, 1e-4)]]), rtol=1e-9, atol=0)
    # sampling weights fold into w: log w = sum(log-ratios) + sum(log weights clamped to [log 1e-8, 20])
    sampling = t([[2.0, 0.5], [1e-12, 1.0], [math.exp(25.0), math.exp(-21.0)]])
    folded = gamma_weights(advantages, t([[0.1, 0.2], [0.0, 0.0], [0.0, 0.0]]), mask, sampling,
                           k_pos=1.0, lambda_pos=1e-3)
    expected = [[phi(0.3, True, 1.0, 1e-3)], [phi(low, True, 1.0, 1e-3)],
                [phi(max(low, 20.0 + max(low, -21.0)), True, 1.0, 1e-3)]]
    torch.testing.assert_close(folded, t(expected), rtol=1e-5, atol=0)
    # log w below log 1e-8 counts as log 1e-8 (-20 is not -18.42...): a weight of 1e-8 x e^(1e-3 ...)
    assert below.item() != phi(-20.0, True, 1.0, 1e-3)


def test_vespo_gamma_weights_that_overflow_or_are_nan_are_zero():
    mask = torch.ones(1, 2, dtype=D)
    # k = 100 at log w = 10: exp(1e-4 + 1000 - 1e-4 e^10) overflows to inf: weight 0
    big = gamma_weights(t([[1.0]]), t([[4.0, 6.0]]), mask, k_pos=100.0, lambda_pos=1e-4)
    assert big.tolist() == [[0.0]]
    # a NaN log-ratio (even under the mask: NaN x 0 is NaN) gives NaN: weight 0
    nan = gamma_weights(t([[1.0], [1.0]]), t([[0.1, float("nan")], [0.1, 0.2]]),
                        t([[1.0, 0.0], [1.0, 1.0]]))
    assert nan[0].item() == 0.0 and nan[1].item() == pytest.approx(phi(0.3, True), rel=1e-12)


def test_vespo_term_is_minus_phi_a_logp_with_old_logps():
    logps = t([[-1.0, -2.0], [-0.5, -0.25]]).requires_grad_(True)
    old = t([[-1.2, -1.9], [-0.5, -0.75]])
    vespo = Objective(epsilon_low=0.2, epsilon_high=0.2, loss_type="vespo",
                      vespo={"k_pos": 1.0, "lambda_pos": 2.0})
    loss, _ = per_token_policy_loss(logps, old, t([2.0, -1.0]), vespo)
    p0, p1 = phi(0.1, True, 1.0, 2.0), phi(0.5, False)
    torch.testing.assert_close(loss, t([[p0 * 2.0, p0 * 4.0], [-p1 * 0.5, -p1 * 0.25]]))
    loss.sum().backward()   # phi is detached
    torch.testing.assert_close(logps.grad, t([[-2 * p0, -2 * p0], [p1, p1]]))


def test_vespo_takes_sampling_weights_into_phi_not_as_a_factor():
    logps = t([[-1.0, -2.0]])
    sampling = t([[2.0, 1.5]])
    loss, _ = per_token_policy_loss(logps, logps, t([1.0]),
                                    Objective(epsilon_low=0.2, epsilon_high=0.2, loss_type="vespo"),
                                    sampling_weights=sampling)
    p = phi(LN(3.0), True)
    torch.testing.assert_close(loss, t([[-p * -1.0, -p * -2.0]]))


def test_sampling_weights_and_policy_mask_multiply_the_policy_term_only():
    logps = t([[LN(1.1), 0.0]])
    ref = t([[0.5, -0.5]])
    loss, stats = per_token_policy_loss(
        logps, torch.zeros_like(logps), t([1.0]),
        Objective(epsilon_low=0.2, epsilon_high=0.2, loss_type="grpo", use_bias_correction_kl=False),
        beta=0.1, ref_logps=ref, sampling_weights=t([[2.0, 3.0]]), policy_mask=t([[1.0, 0.0]]))
    kl = [math.exp(0.5 - LN(1.1)) - (0.5 - LN(1.1)) - 1, math.exp(-0.5) + 0.5 - 1]
    torch.testing.assert_close(stats["kl"], t([kl]))
    torch.testing.assert_close(loss, t([[-1.1 * 2.0 + 0.1 * kl[0], 0.1 * kl[1]]]))


# ------------------------------------------------------------------------- KL


def test_kl_is_k3_of_ref_minus_logp_and_its_bias_correction_is_times_rho():
    logps = t([[LN(1.5), -1.0]])
    old = t([[0.0, -1.0]])
    ref = t([[0.2, -0.5]])
    diffs = [0.2 - LN(1.5), 0.5]
    kl = [math.exp(d) - d - 1 for d in diffs]
    for bias_correction, factor in ((True, [1.5, 1.0]), (False, [1.0, 1.0])):
        objective = Objective(epsilon_low=0.2, epsilon_high=0.2,
                              use_bias_correction_kl=bias_correction)
        loss, stats = per_token_policy_loss(logps, old, t([0.0]), objective, beta=0.25,
                                            ref_logps=ref)
        torch.testing.assert_close(stats["kl"], t([kl]))
        torch.testing.assert_close(loss, t([[0.25 * k * f for k, f in zip(kl, factor)]]))


def test_no_reference_gives_a_zero_kl():
    _, stats = loss_of("grpo")
    assert torch.equal(stats["kl"], torch.zeros(2, 3, dtype=D))


# ------------------------------------------------------------------------- ratios


def test_sequence_level_ratio_is_the_exp_of_the_masked_mean_log_ratio():
    logps = t([[0.3, 0.1, 9.0], [0.0, 0.0, 0.0]])
    mask = t([[1, 1, 0], [0, 0, 0]])
    ratio = importance_ratio(logps, torch.zeros_like(logps), mask, "sequence")
    torch.testing.assert_close(ratio, t([[math.exp(0.2)], [1.0]]))
    torch.testing.assert_close(importance_ratio(logps, logps - 0.5, None), torch.full((2, 3), math.exp(0.5), dtype=D))
    with pytest.raises(ValueError, match="completion_mask"):
        importance_ratio(logps, logps, None, "sequence")
    with pytest.raises(ValueError, match="importance_sampling_level"):
        importance_ratio(logps, logps, mask, "tokens")


def test_gspo_clips_the_sequence_ratio():
    logps = t([[LN(2.0), LN(2.0)], [LN(0.5), LN(0.5)]])
    gspo = Objective(epsilon_low=0.2, epsilon_high=0.3, loss_type="luspo",
                     importance_sampling_level="sequence")
    loss, stats = per_token_policy_loss(logps, torch.zeros_like(logps), t([1.0, -1.0]), gspo)
    torch.testing.assert_close(loss, t([[-1.3, -1.3], [0.8, 0.8]]))
    assert stats["is_region_clipped"].all()


# ------------------------------------------------------------------------- reductions

PER_TOKEN = [[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 0.0, 0.0], [5.0, 7.0, 9.0, 0.0]]
MASK = [[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]]   # 9 tokens, masked sum 10 + 30 + 21 = 61


@pytest.mark.parametrize("loss_type, expected", [
    ("grpo", (2.5 + 15.0 + 7.0) / 3), ("sapo", (2.5 + 15.0 + 7.0) / 3),
    ("luspo", 61 / 3), ("dr_grpo", 61 / (3 * 8)), ("bnpo", 61 / 9),
    ("dapo", 61 / 9), ("cispo", 61 / 9), ("vespo", 61 / 9)])
def test_each_reduction_by_hand(loss_type, expected):
    got = reduce_loss(t(PER_TOKEN), t(MASK), loss_type, max_completion_length=8)
    assert got.item() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("loss_type, expected", [
    ("grpo", (2.5 + 15.0 + 7.0) / 6), ("luspo", 61 / 6), ("dr_grpo", 61 / (6 * 8)),
    ("bnpo", 61 / 9 / 4), ("dapo", 61 / 40), ("cispo", 61 / 40), ("vespo", 61 / 40)])
def test_reductions_with_the_updates_totals(loss_type, expected):
    got = reduce_loss(t(PER_TOKEN), t(MASK), loss_type, max_completion_length=8, total_sequences=6,
                      total_tokens=40, accumulation_steps=4)
    assert got.item() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("loss_type", ["grpo", "luspo", "dr_grpo", "bnpo", "dapo"])
def test_a_one_sequence_update_is_not_scaled(loss_type):
    # one sequence, 2 tokens, max length 1... 4: its loss is its own mean / sum, never halved
    expected = {"grpo": 3.0, "luspo": 6.0, "dr_grpo": 6.0 / 4, "bnpo": 3.0, "dapo": 3.0}[loss_type]
    got = reduce_loss(t([[2.0, 4.0]]), t([[1, 1]]), loss_type, max_completion_length=4)
    assert got.item() == pytest.approx(expected)
    one = reduce_loss(t([[2.0, 4.0]]), t([[1, 1]]), loss_type, max_completion_length=4,
                      total_sequences=1, total_tokens=2)
    assert one.item() == pytest.approx(expected)


def test_fractional_masks_count_at_least_one_token():
    # the token count is clamped to >= 1: a mask summing to 0.5 divides by 1, not 0.5
    per_token, mask = t([[4.0, 8.0]]), t([[0.5, 0.0]])
    assert reduce_loss(per_token, mask, "bnpo", max_completion_length=2).item() == pytest.approx(2.0)
    assert reduce_loss(per_token, mask, "dapo", max_completion_length=2).item() == pytest.approx(2.0)
    assert reduce_loss(per_token, mask, "dapo", max_completion_length=2,
                       total_tokens=0.5).item() == pytest.approx(2.0)
    assert masked_mean(per_token, mask).item() == pytest.approx(2.0)
    assert masked_mean(per_token, mask, dim=1).tolist() == pytest.approx([2.0])
    assert masked_mean(t([[1.0, 3.0], [5.0, 7.0]]), t([[1, 1], [0, 1]]), dim=0).tolist() == [1.0, 5.0]


def test_reduce_loss_bounds_are_inclusive():
    per_token, mask = t([[1.0]]), t([[1]])
    reduce_loss(per_token, mask, "dapo", max_completion_length=1, total_sequences=1, total_tokens=0,
                accumulation_steps=1)
    for bad in ({"max_completion_length": 0}, {"total_sequences": 0}, {"total_tokens": -1},
                {"accumulation_steps": 0}):
        kwargs = {"max_completion_length": 1, **bad}
        with pytest.raises(ValueError, match=next(iter(bad))):
            reduce_loss(per_token, mask, "dapo", **kwargs)


# ------------------------------------------------------------------------- entropy bonus


def test_entropy_bonus_is_the_masked_mean_over_the_accumulation_steps():
    entropies = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    assert entropy_bonus(entropies, mask).item() == pytest.approx(7.0 / 3)
    assert entropy_bonus(entropies, mask, 4).item() == pytest.approx(7.0 / 3 / 4)
    assert entropy_bonus(entropies, mask.bool(), accumulation_steps=2).item() == pytest.approx(7.0 / 6)
    # an empty or fractional mask divides by at least one token
    assert entropy_bonus(entropies, torch.zeros(2, 3, dtype=D)).item() == 0.0
    assert entropy_bonus(entropies, t([[0.5, 0, 0], [0, 0, 0]])).item() == pytest.approx(0.5)


def test_router_aux_loss_and_coefficient():
    aux = [t(1.0), t(3.0)]
    assert router_aux_loss(aux, 0.5, accumulation_steps=4).item() == pytest.approx(0.5 * 2.0 / 4)
    assert router_aux_loss(aux, 0.5).item() == pytest.approx(1.0)
    assert router_aux_coef(None, True, 0.02) == 0.02
    assert router_aux_coef(None, True, None) == 0.0
    assert router_aux_coef(0.1, True, 0.02) == 0.1
    assert router_aux_coef(0.0, True, 0.02) == 0.0
    assert router_aux_coef(None, False, 0.02) == 0.0
    assert router_aux_coef(0.0, False, None) == 0.0
    with pytest.raises(ValueError, match="router_aux_loss_coef is 0.1"):
        router_aux_coef(0.1, False, None)


# ------------------------------------------------------------------------- masks


def test_off_policy_mask_by_hand():
    # mean KL(sampler || policy) = mean(sampler - logp) over the mask; threshold 0.3
    logps = torch.full((6, 2), -1.0, dtype=D)
    sampler = t([[0.5, 0.5],     # A > 0, KL 0.5: kept (only negative advantages are masked)
                 [0.5, 0.5],     # A < 0, KL 0.5 > 0.3: masked
                 [0.1, 0.1],     # A < 0, KL 0.1: kept
                 [-0.5, -0.5],   # A < 0, KL -0.5 (policy above the sampler): kept
                 [0.25, 9.0],    # A < 0, KL over the first token only = 0.25: kept
                 [0.5, -9.0]])   # A < 0, KL over the first token only = 0.5: masked
    sampler = sampler - 1.0      # log-probs of -1 + the KL above
    mask = t([[1, 1], [1, 1], [1, 1], [1, 1], [1, 0], [1, 0]])
    advantages = t([1.0, -1.0, -1.0, -1.0, -1.0, -1.0])
    keep = off_policy_mask(advantages, logps, sampler, mask, 0.3)
    assert keep.dtype == D and keep.shape == (6, 1)
    assert keep.flatten().tolist() == [1.0, 0.0, 1.0, 1.0, 1.0, 0.0]
    # the threshold is inclusive: a mean KL of exactly 0.25 is kept at 0.25
    assert off_policy_mask(t([-1.0]), t([[0.0]]), t([[0.25]]), t([[1.0]]), 0.25).item() == 1.0
    # A = 0 counts as non-negative; NaN sampler log-probs count as KL 0; an empty row has KL 0
    keep = off_policy_mask(t([0.0, -1.0, -1.0]), torch.zeros(3, 2, dtype=D),
                           t([[5.0, 5.0], [float("nan"), 0.2], [5.0, 5.0]]),
                           t([[1, 1], [1, 1], [0, 0]]).bool(), 0.1)
    assert keep.dtype == torch.bool and keep.flatten().tolist() == [True, True, True]
    keep = off_policy_mask(t([-1.0]), torch.zeros(1, 2, dtype=D), t([[0.2, 0.2]]), t([[1, 1]]), 0.1)
    assert keep.item() == 0.0


def test_off_policy_mask_on_the_loss_masks_negative_sequences_only():
    logps = torch.zeros(2, 2, dtype=D)
    keep = off_policy_mask(t([1.0, -1.0]), logps, torch.ones(2, 2, dtype=D), torch.ones(2, 2, dtype=D), 0.5)
    loss, _ = per_token_policy_loss(logps, logps, t([1.0, -1.0]),
                                    Objective(epsilon_low=0.2, epsilon_high=0.2), policy_mask=keep)
    torch.testing.assert_close(loss, t([[-1.0, -1.0], [0.0, 0.0]]))


def test_high_entropy_mask_by_hand():
    # values exact in float32 (the quantile is taken in float32)
    entropies = t([[0.125, 0.5, 0.875], [0.25, 0.75, 5.0]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    # the 0.6 quantile of [0.125, 0.25, 0.5, 0.75, 0.875] is 0.6 (linear): keeps 0.75 and 0.875
    got = high_entropy_mask(entropies, mask, 0.4)
    assert got.tolist() == [[False, False, True], [False, True, False]]
    assert high_entropy_mask(entropies, mask, 1.0).tolist() == mask.bool().tolist()
    assert high_entropy_mask(entropies, mask, 0.0).tolist() == [[False, False, True], [False, False, False]]
    # a token exactly at the threshold is kept (the 0.5 quantile of the pool is 0.5)
    assert high_entropy_mask(entropies, mask, 0.5).tolist() == [[False, True, True], [False, True, False]]
    # the quantile over other entropies (every process's): threshold 0.625 of [0.0, 0.625, 1.25]
    got = high_entropy_mask(entropies, mask, 0.5, all_entropies=t([0.0, 0.625, 1.25]))
    assert got.tolist() == [[False, False, True], [False, True, False]]
    assert not high_entropy_mask(entropies, torch.zeros(2, 3, dtype=D), 0.5).any()
    for bad in (-0.1, 1.1):
        with pytest.raises(ValueError, match="top_entropy_quantile"):
            high_entropy_mask(entropies, mask, bad)


# ------------------------------------------------------------------------- sampler correction


def test_sampler_importance_weights_by_hand():
    policy = t([[LN(4.0), LN(0.2), 0.0], [LN(2.0), LN(2.0), 7.0]])
    sampler = torch.zeros(2, 3, dtype=D)
    mask = t([[1, 1, 1], [1, 1, 0]])
    w = sampler_importance_weights(policy, sampler, mask, "token_truncate", clip_min=0.5, clip_max=3.0)
    torch.testing.assert_close(w.double(), t([[3.0, 0.5, 1.0], [2.0, 2.0, 1.0]]))
    w = sampler_importance_weights(policy, sampler, mask, "token_mask", clip_min=0.5, clip_max=3.0)
    torch.testing.assert_close(w.double(), t([[0.0, 0.0, 1.0], [2.0, 2.0, 1.0]]))
    # bounds are inclusive in mask modes (a ratio of exactly 1 at both bounds is kept)
    w = sampler_importance_weights(policy, sampler, mask, "token_mask", clip_min=1.0, clip_max=1.0)
    torch.testing.assert_close(w.double(), t([[0.0, 0.0, 1.0], [0.0, 0.0, 1.0]]))
    w = sampler_importance_weights(policy, sampler, mask, "sequence_truncate", clip_min=None, clip_max=3.0)
    torch.testing.assert_close(w.double(), t([[0.8], [3.0]]))
    w = sampler_importance_weights(policy, sampler, mask, "sequence_mask", clip_min=0.9, clip_max=None)
    torch.testing.assert_close(w.double(), t([[0.0], [4.0]]))
    w = sampler_importance_weights(policy, sampler, mask, "sequence_mask", clip_min=None, clip_max=1.0)
    torch.testing.assert_close(w.double(), t([[0.8], [0.0]]))
    with pytest.raises(ValueError, match="set clip_min or clip_max"):
        sampler_importance_weights(policy, sampler, mask, "token_truncate", clip_min=None, clip_max=None)
    with pytest.raises(ValueError, match="importance sampling mode"):
        sampler_importance_weights(policy, sampler, mask, "token")


def test_sampler_correction_stats_by_hand():
    policy = t([[LN(4.0), LN(0.5), 0.0], [0.3, 0.0, 0.0]])
    sampler = t([[0.0, 0.0, 0.0], [0.0, float("nan"), 0.0]])
    mask = t([[1, 1, 0], [1, 1, 0]])
    weights = t([[4.0, 0.5, 9.0], [1.2, 1.0, 9.0]])
    s = sampler_correction_stats(policy, sampler, mask, weights)
    assert s["ratio_sum"].item() == pytest.approx(6.7) and s["ratio_count"].item() == 4
    assert s["ratio_min"].item() == 0.5 and s["ratio_max"].item() == 4.0
    assert s["logp_diff_count"].item() == 3   # the NaN sampler token is left out
    assert s["logp_diff_sum"].item() == pytest.approx(LN(4.0) + LN(2.0) + 0.3)
    assert s["logp_diff_min"].item() == pytest.approx(0.3)
    assert s["logp_diff_max"].item() == pytest.approx(LN(4.0))
    seq = sampler_correction_stats(policy, sampler, mask, t([[2.0], [3.0]]))
    assert seq["ratio_sum"].item() == 5.0 and seq["ratio_count"].item() == 2
    empty = sampler_correction_stats(policy, sampler, torch.zeros(2, 3, dtype=D), weights)
    assert empty["ratio_count"].item() == 0 and empty["ratio_min"].item() == math.inf
    assert empty["ratio_max"].item() == -math.inf and empty["logp_diff_sum"].item() == 0.0


def test_top_entropy_quantile_one_keeps_every_token_of_float64_entropies():
    """The threshold is a float32 quantile; entropies are compared in float32 too, so 1.0 keeps
    the lowest token (0.1 in float64 is below its float32 rounding: it was dropped)."""
    from cppo.algorithm.masks import high_entropy_mask
    entropies = torch.tensor([[0.1, 0.3, 0.7]], dtype=torch.float64)
    assert high_entropy_mask(entropies, torch.ones(1, 3), 1.0).all()


# ------------------------------------------------------------------------- mutation work (#54)


def test_sequence_ratio_divides_each_row_by_its_own_token_count():
    logps = t([[0.6, 0.0, 0.0], [0.3, 0.6, 0.9], [0.5, 7.0, 7.0]])
    mask = t([[1, 0, 0], [1, 1, 1], [1, 0, 0]])
    ratio = importance_ratio(logps, torch.zeros_like(logps), mask, "sequence")
    # one token: exp(0.6); three: exp(1.8 / 3); one: exp(0.5)
    torch.testing.assert_close(ratio, t([[math.exp(0.6)], [math.exp(0.6)], [math.exp(0.5)]]),
                               rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match=r"^importance_sampling_level='sequence' needs completion_mask$"):
        importance_ratio(logps, logps, None, "sequence")


def test_per_token_loss_passes_the_mask_and_level_to_the_ratio():
    # GSPO through per_token_policy_loss: the masked token's 9.0 must not count
    # (token level, or a mask of ones, would clip the first row at 1.3)
    logps = t([[LN(1.125), 9.0], [LN(0.5), LN(0.5)]])
    gspo = Objective(epsilon_low=0.2, epsilon_high=0.3, loss_type="grpo",
                     importance_sampling_level="sequence")
    loss, stats = per_token_policy_loss(logps, torch.zeros_like(logps), t([1.0, -1.0]), gspo,
                                        completion_mask=t([[1, 0], [1, 1]]))
    torch.testing.assert_close(loss, t([[-1.125, -1.125], [0.8, 0.8]]), rtol=1e-12, atol=0)
    assert stats["is_high_clipped"].tolist() == [[False, False], [False, False]]
    assert stats["is_low_clipped"].tolist() == [[False, False], [True, True]]


def test_the_loss_has_the_log_probs_dtype():
    logps = torch.tensor([[-1.0, -0.5]], dtype=torch.float32)
    loss, _ = per_token_policy_loss(logps, logps - 0.25, t([0.1]),
                                    Objective(epsilon_low=0.2, epsilon_high=0.2, loss_type="grpo"),
                                    policy_mask=torch.tensor([[1.0, 0.0]], dtype=D))
    assert loss.dtype == torch.float32
    assert loss[0, 1].item() == 0.0
    assert abs(loss[0, 0].item() - (-1.2 * 0.1)) < 1e-7   # ratio e^0.25 clipped at 1.2


def test_checked_inputs_name_what_is_wrong():
    logps = t([[-1.0, -0.5]])
    with pytest.raises(ValueError, match=r"^logps must be \(sequences, tokens\), got shape \(2,\)$"):
        per_token_policy_loss(logps[0], None, t([1.0]),
                              Objective(epsilon_low=0.2, epsilon_high=0.2))
    with pytest.raises(ValueError, match=r"^loss_type must be one of \('grpo', .*\), got 'ppo'$"):
        per_token_policy_loss(logps, None, t([1.0]),
                              Objective(epsilon_low=0.2, epsilon_high=0.2, loss_type="ppo"))
    with pytest.raises(ValueError, match=r"^sampling_weights shape \(1, 3\) must equal logps shape \(1, 2\)$"):
        per_token_policy_loss(logps, None, t([1.0]), Objective(epsilon_low=0.2, epsilon_high=0.2),
                              sampling_weights=torch.ones(1, 3, dtype=D))


def test_cispo_counts_high_clipping_strictly_above_and_for_positive_advantages():
    logps = t([[0.0, LN(2.0)], [LN(2.0), 0.0]])
    # ratio 1 = epsilon_high: not clipped; ratio 2 with A = 0: not counted
    _, stats = per_token_policy_loss(logps, torch.zeros_like(logps), t([1.0, 0.0]),
                                     Objective(epsilon_low=0.2, epsilon_high=1.0, loss_type="cispo"))
    assert stats["is_high_clipped"].tolist() == [[False, True], [False, False]]


def test_checked_inputs_name_the_reference_and_the_epsilons():
    logps = t([[-1.0, -0.5]])
    with pytest.raises(ValueError, match=r"^ref_logps shape \(1, 3\) must equal logps shape \(1, 2\)$"):
        per_token_policy_loss(logps, None, t([1.0]), Objective(epsilon_low=0.2, epsilon_high=0.2),
                              ref_logps=torch.zeros(1, 3, dtype=D))
    for low, high in ((-0.1, 0.2), (0.2, -0.1)):
        with pytest.raises(ValueError, match=rf"^epsilon_low and epsilon_high must be >= 0, got {low} and {high}$"):
            per_token_policy_loss(logps, None, t([1.0]),
                                  Objective(epsilon_low=low, epsilon_high=high))
    # 0 is a bound: the ratio 1 stays, the term is -A
    for low, high in ((0.0, 0.2), (0.2, 0.0), (0.0, 0.0)):
        loss, _ = per_token_policy_loss(logps, None, t([1.0]),
                                        Objective(epsilon_low=low, epsilon_high=high))
        assert loss.tolist() == [[-1.0, -1.0]]


def test_reduce_loss_has_the_per_token_dtype_and_takes_fractional_totals():
    per_token = torch.tensor([[1.0, 3.0]], dtype=torch.float32)
    loss = reduce_loss(per_token, torch.tensor([[1.0, 1.0]], dtype=D), "bnpo", max_completion_length=2)
    assert loss.dtype == torch.float32 and loss.item() == 2.0
    # dapo over the update's token count, a float here (e.g. averaged over processes): 4 / 3.3
    loss = reduce_loss(t([[1.0, 3.0]]), t([[1.0, 1.0]]), "dapo", max_completion_length=2,
                       total_tokens=3.3)
    assert loss.item() == 4.0 / 3.3
    per_token, mask = t([[1.0, 3.0]]), t([[1.0, 1.0]])
    torch.set_default_device("meta")   # the count is made on the loss's device
    try:
        on_cpu = reduce_loss(per_token, mask, "dapo", max_completion_length=2, total_tokens=8)
    finally:
        torch.set_default_device(None)
    assert on_cpu.item() == 0.5
