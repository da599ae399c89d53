import math

import pytest
import torch

from cppo.algorithm import LOSS_TYPES, Objective, masked_mean, per_token_policy_loss, reduce_loss

# ---------------------------------------------------------------- independent references (plain Python)


def reference_per_token(logps, old_logps, advantages, eps_low, eps_high, beta=0.0, ref_logps=None,
                        bias_correction=True):
    """Token-by-token loops with the math module (bias_correction: the KL times the ratio)."""
    rows = []
    for i, (row, old_row) in enumerate(zip(logps, old_logps)):
        out = []
        for t, (logp, old) in enumerate(zip(row, old_row)):
            ratio = math.exp(logp - old)
            clipped = min(max(ratio, 1 - eps_low), 1 + eps_high)
            loss = -min(ratio * advantages[i], clipped * advantages[i])
            if beta:
                diff = ref_logps[i][t] - logp
                loss += beta * (math.exp(diff) - diff - 1) * (ratio if bias_correction else 1.0)
            out.append(loss)
        rows.append(out)
    return rows


def reference_reduce(per_token, mask, loss_type, max_len, total_sequences=None, total_tokens=None):
    """Loops over sequences and tokens; a mask entry is a weight (0 / 1 for bool masks)."""
    per_token, mask = per_token.tolist(), mask.float().tolist()
    sequence_sums, sequence_tokens = [], []
    for losses, weights in zip(per_token, mask):
        total, count = 0.0, 0.0
        for loss, weight in zip(losses, weights):
            if weight:
                total += loss * weight
                count += weight
        sequence_sums.append(total)
        sequence_tokens.append(count)
    sequences = total_sequences if total_sequences is not None else len(per_token)
    tokens = total_tokens if total_tokens is not None else sum(sequence_tokens)
    if loss_type == "luspo":
        return sum(sequence_sums) / sequences
    if loss_type in ("grpo", "sapo"):
        means = [s / n if n else 0.0 for s, n in zip(sequence_sums, sequence_tokens)]
        return sum(means) / sequences
    if loss_type == "dr_grpo":
        return sum(sequence_sums) / (sequences * max_len)
    if loss_type == "bnpo":  # TRL: always this micro-batch's own tokens
        return sum(sequence_sums) / max(sum(sequence_tokens), 1)
    return sum(sequence_sums) / max(tokens, 1)  # dapo, cispo, vespo


def make_batch(seed, num_sequences=6, max_len=7):
    generator = torch.Generator().manual_seed(seed)
    per_token = torch.randn(num_sequences, max_len, generator=generator, dtype=torch.float64)
    lengths = torch.randint(1, max_len + 1, (num_sequences,), generator=generator)
    lengths[2] = 0  # a sequence with no completion tokens
    mask = torch.arange(max_len).unsqueeze(0) < lengths.unsqueeze(1)
    return per_token, mask


# ---------------------------------------------------------------- per_token_policy_loss


def test_per_token_loss_matches_reference_loops():
    generator = torch.Generator().manual_seed(0)
    logps = -torch.rand(3, 5, generator=generator, dtype=torch.float64) * 3
    old_logps = logps + 0.4 * torch.randn(3, 5, generator=generator, dtype=torch.float64)
    ref_logps = logps + 0.3 * torch.randn(3, 5, generator=generator, dtype=torch.float64)
    advantages = torch.tensor([1.5, -0.7, 0.0], dtype=torch.float64)
    loss, _ = per_token_policy_loss(
        logps, old_logps, advantages, Objective(epsilon_low=0.2, epsilon_high=0.28), beta=0.04,
        ref_logps=ref_logps)
    expected = reference_per_token(
        logps.tolist(), old_logps.tolist(), advantages.tolist(), 0.2, 0.28, 0.04, ref_logps.tolist()
    )
    torch.testing.assert_close(loss, torch.tensor(expected, dtype=torch.float64))


def test_ratio_one_gives_minus_advantage_and_its_gradient():
    logps = torch.log(torch.tensor([[0.5, 0.25], [0.1, 0.9]])).requires_grad_()
    advantages = torch.tensor([2.0, -1.0])
    loss, stats = per_token_policy_loss(logps, None, advantages,
                                        Objective(epsilon_low=0.2, epsilon_high=0.2))
    torch.testing.assert_close(loss, torch.tensor([[-2.0, -2.0], [1.0, 1.0]]))
    loss.sum().backward()
    # d(-rho A)/d logp = -rho A = -A at rho = 1
    torch.testing.assert_close(logps.grad, torch.tensor([[-2.0, -2.0], [1.0, 1.0]]))
    assert not stats["is_region_clipped"].any()
    assert torch.equal(stats["kl"], torch.zeros(2, 2))


def test_advantages_may_be_a_column():
    logps = torch.zeros(2, 3)
    flat, _ = per_token_policy_loss(logps, logps, torch.tensor([1.0, 2.0]),
                                    Objective(epsilon_low=0.2, epsilon_high=0.2))
    column, _ = per_token_policy_loss(logps, logps, torch.tensor([[1.0], [2.0]]),
                                      Objective(epsilon_low=0.2, epsilon_high=0.2))
    assert torch.equal(flat, column)


def test_k3_kl_known_values():
    logps = torch.zeros(1, 3, dtype=torch.float64)
    ref_logps = torch.tensor([[0.0, 1.0, -1.0]], dtype=torch.float64)  # ref - logp = 0, 1, -1
    loss, stats = per_token_policy_loss(
        logps, logps, torch.zeros(1, dtype=torch.float64),
        Objective(epsilon_low=0.2, epsilon_high=0.2), beta=0.5, ref_logps=ref_logps)
    expected_kl = torch.tensor([[0.0, math.e - 2.0, math.exp(-1.0)]], dtype=torch.float64)
    torch.testing.assert_close(stats["kl"], expected_kl)
    assert stats["kl"][0, 0].item() == 0.0 and (stats["kl"][0, 1:] > 0).all()
    torch.testing.assert_close(loss, 0.5 * expected_kl)  # A = 0: only the KL term


def test_kl_reported_without_penalty_when_ref_given():
    logps = torch.zeros(1, 2)
    ref_logps = torch.tensor([[1.0, 0.0]])
    loss, stats = per_token_policy_loss(logps, logps, torch.ones(1),
                                        Objective(epsilon_low=0.2, epsilon_high=0.2),
                                        ref_logps=ref_logps)
    torch.testing.assert_close(loss, -torch.ones(1, 2))
    assert stats["kl"][0, 0].item() == pytest.approx(math.e - 2)


@pytest.mark.parametrize("bias_correction", [False, True])
def test_kl_gradient_pulls_towards_reference(bias_correction):
    logps = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref_logps = torch.tensor([[-0.5, -2.5]])
    loss, _ = per_token_policy_loss(
        logps, logps.detach(), torch.zeros(1),
        Objective(epsilon_low=0.2, epsilon_high=0.2, use_bias_correction_kl=bias_correction),
        beta=1.0, ref_logps=ref_logps)
    loss.sum().backward()
    # d/dlogp [exp(ref - logp) - (ref - logp) - 1] = 1 - exp(ref - logp); with the ratio rho
    # (= 1 here, d rho / d logp = 1), the KL itself is added: d/dlogp [KL rho] = dKL + KL
    diff = ref_logps - logps.detach()
    expected = 1 - torch.exp(diff)
    if bias_correction:
        expected = expected + torch.exp(diff) - diff - 1
    torch.testing.assert_close(logps.grad, expected)
    assert logps.grad[0, 0] < 0 < logps.grad[0, 1]  # descent raises logp below ref, lowers it above


def test_beta_without_reference_is_an_error():
    logps = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=r"beta=0.04 .* needs ref_logps"):
        per_token_policy_loss(logps, logps, torch.ones(1),
                              Objective(epsilon_low=0.2, epsilon_high=0.2), beta=0.04)


def test_shape_errors():
    logps = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"advantages must have shape \(2,\).*got \(3,\)"):
        per_token_policy_loss(logps, logps, torch.ones(3),
                              Objective(epsilon_low=0.2, epsilon_high=0.2))
    with pytest.raises(ValueError, match=r"old_logps shape \(2, 4\) must equal logps shape \(2, 3\)"):
        per_token_policy_loss(logps, torch.zeros(2, 4), torch.ones(2),
                              Objective(epsilon_low=0.2, epsilon_high=0.2))


def test_zero_advantage_is_never_counted_as_clipped():
    old_logps = torch.zeros(1, 3)
    logps = torch.log(torch.tensor([[1.5, 0.5, 1.0]]))
    loss, stats = per_token_policy_loss(logps, old_logps, torch.zeros(1),
                                        Objective(epsilon_low=0.2, epsilon_high=0.2))
    assert torch.equal(loss, torch.zeros(1, 3))
    assert not stats["is_region_clipped"].any()


def test_clipping_engages_when_policy_moved_away_from_old():
    """num_iterations > 1: the ratio leaves 1, clipping and its metrics engage."""
    # token ratios:            1.5        0.5        1.25       1.0
    ratios = torch.tensor([[1.5, 0.5, 1.25, 1.0], [1.5, 0.5, 1.25, 0.7]], dtype=torch.float64)
    old_logps = torch.full((2, 4), -1.0, dtype=torch.float64)
    logps = (old_logps + ratios.log()).requires_grad_()
    advantages = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, stats = per_token_policy_loss(logps, old_logps, advantages,
                                        Objective(epsilon_low=0.2, epsilon_high=0.28))

    # A > 0: ratio 1.5 > 1.28 is clipped high; 0.5 is not clipped (min keeps rho A); 1.25 < 1.28 not clipped
    # A < 0: ratio 0.5 < 0.8 and 0.7 < 0.8 are clipped low; 1.5 and 1.25 are not (min keeps rho A)
    expected_high = torch.tensor([[True, False, False, False], [False] * 4])
    expected_low = torch.tensor([[False] * 4, [False, True, False, True]])
    assert torch.equal(stats["is_high_clipped"], expected_high)
    assert torch.equal(stats["is_low_clipped"], expected_low)
    assert torch.equal(stats["is_region_clipped"], expected_high | expected_low)
    expected_loss = torch.tensor(
        [[-1.28, -0.5, -1.25, -1.0], [1.5, 0.8, 1.25, 0.8]], dtype=torch.float64
    )
    torch.testing.assert_close(loss, expected_loss)

    loss.sum().backward()
    clipped = expected_high | expected_low
    assert torch.all(logps.grad[clipped] == 0)
    # unclipped tokens: d(-rho A)/dlogp = -rho A
    torch.testing.assert_close(logps.grad[~clipped], (-ratios * advantages.unsqueeze(1))[~clipped])
    assert torch.all(logps.grad[~clipped] != 0)
    # TRL's clip_ratio/region_mean over a full mask
    assert masked_mean(stats["is_region_clipped"].float(), torch.ones(2, 4)).item() == pytest.approx(3 / 8)


# ---------------------------------------------------------------- reduce_loss


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32, torch.float64])
def test_reduce_matches_reference_loops(loss_type, mask_dtype):
    per_token, mask = make_batch(seed=1)
    loss = reduce_loss(per_token, mask.to(mask_dtype), loss_type, max_completion_length=10)
    expected = reference_reduce(per_token, mask, loss_type, max_len=10)
    assert loss.item() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_reduce_with_explicit_totals_matches_reference(loss_type):
    per_token, mask = make_batch(seed=2)
    loss = reduce_loss(per_token, mask, loss_type, max_completion_length=9, total_sequences=20, total_tokens=57)
    expected = reference_reduce(per_token, mask, loss_type, 9, total_sequences=20, total_tokens=57)
    assert loss.item() == pytest.approx(expected, rel=1e-12)


def test_loss_types_differ_on_uneven_lengths():
    per_token, mask = make_batch(seed=3)
    values = {t: reduce_loss(per_token, mask, t, max_completion_length=7).item() for t in LOSS_TYPES}
    assert values["bnpo"] == values["dapo"]  # same without totals: the micro-batch is the update
    assert len({round(values[t], 12) for t in ("grpo", "bnpo", "dr_grpo")}) == 3


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])  # bnpo: per micro-batch (TRL)
def test_gradient_accumulation_sum_equals_full_batch(loss_type):
    generator = torch.Generator().manual_seed(4)
    num_sequences, max_len = 7, 6
    logps = (-torch.rand(num_sequences, max_len, generator=generator, dtype=torch.float64)).requires_grad_()
    old_logps = logps.detach() + 0.3 * torch.randn(num_sequences, max_len, generator=generator, dtype=torch.float64)
    advantages = torch.randn(num_sequences, generator=generator, dtype=torch.float64)
    lengths = torch.tensor([6, 1, 0, 3, 6, 2, 5])
    mask = torch.arange(max_len).unsqueeze(0) < lengths.unsqueeze(1)

    def loss_of(rows, **totals):
        per_token, _ = per_token_policy_loss(
            logps[rows], old_logps[rows], advantages[rows],
            Objective(epsilon_low=0.2, epsilon_high=0.2))
        return reduce_loss(per_token, mask[rows], loss_type, max_completion_length=8, **totals)

    full = loss_of(slice(None))
    (full_grad,) = torch.autograd.grad(full, logps)

    totals = {"total_sequences": num_sequences, "total_tokens": int(mask.sum())}
    micro_batches = [slice(0, 2), slice(2, 5), slice(5, 7)]
    accumulated = sum(loss_of(rows, **totals) for rows in micro_batches)
    (accumulated_grad,) = torch.autograd.grad(accumulated, logps)

    assert accumulated.item() == pytest.approx(full.item(), rel=1e-12)
    torch.testing.assert_close(accumulated_grad, full_grad)

    # without totals the micro-batches normalise by their own counts and the sum is wrong
    naive = sum(loss_of(rows) for rows in micro_batches)
    assert naive.item() != pytest.approx(full.item(), rel=1e-6)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_all_zero_mask_gives_no_nan(loss_type):
    per_token = torch.randn(3, 4, requires_grad=True)
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    loss = reduce_loss(per_token, mask, loss_type, max_completion_length=4)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(per_token.grad).all()
    assert torch.all(per_token.grad[1] == 0)

    everything_masked = reduce_loss(per_token, torch.zeros(3, 4), loss_type, max_completion_length=4)
    assert everything_masked.item() == 0.0


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_masked_positions_never_leak_even_if_nan(loss_type):
    per_token = torch.tensor([[1.0, float("nan")], [2.0, float("inf")]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    loss = reduce_loss(per_token, mask, loss_type, max_completion_length=2)
    assert torch.isfinite(loss)


def test_empty_micro_batch_is_zero():
    loss = reduce_loss(torch.zeros(0, 5), torch.zeros(0, 5, dtype=torch.bool), "grpo", max_completion_length=5)
    assert loss.item() == 0.0


def test_reduce_errors():
    per_token, mask = make_batch(seed=5)
    with pytest.raises(ValueError, match=r"loss_type must be one of \('grpo', 'bnpo', 'dr_grpo', 'dapo', 'luspo', 'cispo', 'sapo', 'vespo'\), got 'sum'"):
        reduce_loss(per_token, mask, "sum", max_completion_length=7)
    with pytest.raises(ValueError, match=r"per_token and completion_mask must both be"):
        reduce_loss(per_token, mask[:, :3], "grpo", max_completion_length=7)
    with pytest.raises(ValueError, match=r"max_completion_length must be >= 1, got 0"):
        reduce_loss(per_token, mask, "dr_grpo", max_completion_length=0)
    with pytest.raises(ValueError, match=r"total_sequences must be >= 1, got 0"):
        reduce_loss(per_token, mask, "grpo", max_completion_length=7, total_sequences=0)


# ---------------------------------------------------------------- masked_mean


def test_masked_mean_values():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 0, 1], [0, 0, 0]], dtype=torch.bool)
    assert masked_mean(values, mask).item() == 2.0
    torch.testing.assert_close(masked_mean(values, mask, dim=1), torch.tensor([2.0, 0.0]))
    assert masked_mean(values, torch.zeros(2, 3)).item() == 0.0
    weights = torch.tensor([[0.5, 0.0, 1.5], [0.0, 0.0, 0.0]])
    assert masked_mean(values, weights).item() == pytest.approx((0.5 + 4.5) / 2.0)


def test_importance_weights_known_values_and_truncation():
    from cppo.algorithm import importance_weights
    policy = torch.log(torch.tensor([[0.5, 0.2], [0.9, 0.05]]))
    sampler = torch.log(torch.tensor([[0.25, 0.2], [0.3, 0.5]]))
    weights = importance_weights(policy, sampler, clip_max=2.5)
    torch.testing.assert_close(weights, torch.tensor([[2.0, 1.0], [2.5, 0.1]]))  # 3.0 -> 2.5
    policy.requires_grad_(True)
    assert not importance_weights(policy, sampler, 3.0).requires_grad   # weights, not a path
    with pytest.raises(ValueError, match="same shape"):
        importance_weights(policy, sampler[:, :1], 3.0)


def test_adaptive_entropy_control_follows_trls_rule():
    """TRL 1.16's use_adaptive_entropy: up by delta at or below the target (capped), down above it
    (floored); the bonus applies only after a step at or below the target (none before any)."""
    from cppo.algorithm import adapted_entropy_coef, applied_entropy_coef
    kw = dict(target=0.2, delta=0.005, coef_min=0.0, coef_max=0.012)
    assert adapted_entropy_coef(0.0, 0.2, **kw) == 0.005           # at the target: up
    assert adapted_entropy_coef(0.01, 0.1, **kw) == 0.012          # capped at coef_max
    assert adapted_entropy_coef(0.003, 0.21, **kw) == 0.0          # floored at coef_min
    assert adapted_entropy_coef(0.01, 0.5, **kw) == pytest.approx(0.005)
    assert applied_entropy_coef(0.01, math.inf, 0.2) == 0.0        # before the first step
    assert applied_entropy_coef(0.01, 0.2, 0.2) == 0.01
    assert applied_entropy_coef(0.01, 0.2001, 0.2) == 0.0
