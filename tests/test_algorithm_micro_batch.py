"""One micro-batch's loss and statistics, and a step's metrics (cppo.algorithm.micro_batch),
without a model: float64 log-probs, and a config that is a plain namespace of the loss fields.
The loss is checked against the terms it is made of (per_token_policy_loss, reduce_loss,
entropy_bonus, the masks, the sampler weights: each tested against hand-derived values in
test_algorithm_terms / test_algorithm_loss / test_sampler_correction), so what is checked here is
which of the config's fields and the micro-batch's tensors go where; the sums and metrics by hand."""

import math
from types import SimpleNamespace

import pytest
import torch

from cppo.algorithm.loss import Objective, entropy_bonus, per_token_policy_loss, reduce_loss
from cppo.algorithm.masks import high_entropy_mask, off_policy_mask
from cppo.algorithm.micro_batch import (MAX_KEYS, SUM_KEYS, LossSettings, add_micro_batch,
                                        empty_sums, entropy_bonus_on, micro_batch_loss,
                                        policy_mask, sampler_weights, step_metrics)
from cppo.algorithm.sampler_correction import sampler_importance_weights

D = torch.float64


def t(values):
    return torch.tensor(values, dtype=D)


def config(**changes):
    """LossSettings from the config's field names (as CPPOConfig.loss_settings() maps them)."""
    f = dict(entropy_coef=0.0, use_adaptive_entropy=False, top_entropy_quantile=1.0,
             off_policy_mask_threshold=None, importance_sampling_mode="token_truncate",
             importance_sampling_clip_min=None, importance_sampling_clip_max=3.0,
             epsilon=0.2, effective_epsilon_high=0.28, beta=0.0, loss_type="grpo",
             max_completion_length=4, importance_sampling_level="token", delta=None,
             use_bias_correction_kl=True, sapo_temperature_pos=0.5,
             sapo_temperature_neg=2.0, vespo=dict(k_pos=1.5, lambda_pos=0.5, k_neg=0.5,
                                                  lambda_neg=1.5))
    f.update(changes)
    return LossSettings(
        beta=f["beta"], max_completion_length=f["max_completion_length"],
        top_entropy_quantile=f["top_entropy_quantile"],
        off_policy_mask_threshold=f["off_policy_mask_threshold"],
        importance_sampling_mode=f["importance_sampling_mode"],
        importance_sampling_clip_min=f["importance_sampling_clip_min"],
        importance_sampling_clip_max=f["importance_sampling_clip_max"],
        entropy_bonus=entropy_bonus_on(f["entropy_coef"], f["use_adaptive_entropy"]),
        objective=Objective(
            epsilon_low=f["epsilon"], epsilon_high=f["effective_epsilon_high"],
            loss_type=f["loss_type"], importance_sampling_level=f["importance_sampling_level"],
            delta=f["delta"], use_bias_correction_kl=f["use_bias_correction_kl"],
            sapo_temperature_pos=f["sapo_temperature_pos"],
            sapo_temperature_neg=f["sapo_temperature_neg"], vespo=f["vespo"]))


def test_the_config_makes_the_loss_settings_field_by_field():
    from cppo.config import CPPOConfig
    cfg = CPPOConfig.from_dict(dict(
        epsilon=0.11, epsilon_high=0.33, beta=0.05, max_completion_length=7, loss_type="sapo",
        top_entropy_quantile=0.4, off_policy_mask_threshold=0.6, entropy_coef=0.01,
        importance_sampling_mode="token_mask", importance_sampling_clip_min=0.25,
        importance_sampling_clip_max=4.0, importance_sampling_level="token", delta=2.5,
        use_bias_correction_kl=True, sapo_temperature_pos=0.7, sapo_temperature_neg=1.3,
        vespo_k_pos=1.1, vespo_lambda_pos=1.2, vespo_k_neg=1.4, vespo_lambda_neg=1.6))
    assert cfg.loss_settings() == LossSettings(
        beta=0.05, max_completion_length=7, top_entropy_quantile=0.4, off_policy_mask_threshold=0.6,
        importance_sampling_mode="token_mask", importance_sampling_clip_min=0.25,
        importance_sampling_clip_max=4.0, entropy_bonus=True,
        objective=Objective(epsilon_low=0.11, epsilon_high=0.33, loss_type="sapo",
                            importance_sampling_level="token", delta=2.5,
                            use_bias_correction_kl=True, sapo_temperature_pos=0.7,
                            sapo_temperature_neg=1.3,
                            vespo=dict(k_pos=1.1, lambda_pos=1.2, k_neg=1.4, lambda_neg=1.6)))
    assert cfg.loss_settings().loss_type == "sapo"
    objective = CPPOConfig.from_dict({"epsilon": 0.3}).loss_settings().objective
    assert objective.epsilon_high == 0.3   # TRL: None
    assert CPPOConfig.from_dict({"use_adaptive_entropy": True}).loss_settings().entropy_bonus


# three completions of up to 3 tokens; ratios exp(logps - old) beyond 1 +- epsilon on some tokens
LOGPS = t([[-1.0, -0.5, -2.0], [-0.2, -1.5, -0.7], [-0.9, -0.1, -0.4]])
OLD = t([[-1.5, -0.4, -2.0], [-0.1, -1.4, -0.7], [-0.9, -0.6, -0.3]])
REF = t([[-1.2, -0.6, -1.0], [-0.3, -1.1, -0.5], [-1.0, -0.2, -0.2]])
SAMPLER = t([[-1.4, -0.5, -1.9], [-0.1, -1.0, -0.6], [-0.8, -0.6, -0.3]])
MASK = t([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
ADVANTAGES = t([1.0, -0.5, 2.0])
ENTROPIES = [t([[0.5, 1.0, 9.0], [0.25, 2.0, 0.75]]), t([[1.5, 9.0, 9.0]])]   # chunks


def micro(**changes):
    fields = dict(loss_mask=MASK, advantages=ADVANTAGES, old_logps=OLD, ref_logps=None,
                  sampler_logps=None)
    fields.update(changes)
    return SimpleNamespace(**fields)


def expected_loss(args, batch, *, weights=None, mask=None, totals=(3, 6), num_micro=2):
    per_token, stats = per_token_policy_loss(   # the micro-batch's loss is in float32
        LOGPS.float(), batch.old_logps, batch.advantages, args.objective, beta=args.beta,
        ref_logps=batch.ref_logps, sampling_weights=weights, completion_mask=batch.loss_mask,
        policy_mask=mask)
    loss = reduce_loss(per_token, batch.loss_mask, args.loss_type,
                       max_completion_length=args.max_completion_length,
                       total_sequences=totals[0], total_tokens=totals[1], accumulation_steps=num_micro)
    return loss, stats


def run(args, batch, entropies=ENTROPIES, coef=0.0, totals=(3, 6), num_micro=2):
    return micro_batch_loss(LOGPS, entropies, batch, args, entropy_coef=coef,
                            total_sequences=totals[0], total_tokens=totals[1], num_micro=num_micro)


# ------------------------------------------------------------------------- the sums


def test_entropy_bonus_is_on_with_a_coefficient_or_adaptive_control():
    assert entropy_bonus_on(0.1, adaptive=False) is True
    assert entropy_bonus_on(0.0, adaptive=True) is True
    assert entropy_bonus_on(0.0, adaptive=False) is False


def test_empty_sums_are_zero_and_the_maxima_minus_infinity():
    sums = empty_sums()
    assert set(sums) == set(SUM_KEYS) | set(MAX_KEYS)
    assert all(sums[k] == 0 for k in SUM_KEYS) and all(sums[k] == -math.inf for k in MAX_KEYS)
    assert type(sums["tokens"]) is int and type(sums["loss"]) is float


def test_add_micro_batch_sums_and_takes_the_maxima():
    totals = empty_sums()
    add_micro_batch(totals, {"loss": 0.5, "tokens": 3, "ratio_max": 2.0, "logp_diff_max": 0.25})
    add_micro_batch(totals, {"loss": 0.25, "tokens": 2, "ratio_max": 1.5, "logp_diff_max": 0.5})
    assert totals["loss"] == 0.75 and totals["tokens"] == 5
    assert totals["ratio_max"] == 2.0 and totals["logp_diff_max"] == 0.5
    assert totals["ratio_min_neg"] == -math.inf and totals["kl"] == 0.0


# ------------------------------------------------------------------------- the step's metrics


def totals_of(**changes):
    totals = {**empty_sums(), "loss": 0.5, "kl": 2.0, "low": 1.0, "high": 2.0, "region": 3.0,
              "tokens": 4, "entropy": 6.0, "ratio_sum": 3.0, "ratio_count": 2.0,
              "logp_diff_sum": 1.0, "logp_diff_count": 0.0, "ratio_max": math.inf,
              "ratio_min_neg": -0.5, "logp_diff_max": 0.25}
    totals.update(changes)
    return totals


def test_step_metrics_by_hand():
    metrics = step_metrics(totals_of(), kl=True, grad_norm=1.5, learning_rate=1e-3,
                           entropy_coef=0.01, sampler_corrected=True)
    assert metrics == {
        "loss": 0.5, "grad_norm": 1.5, "learning_rate": 1e-3,
        "clip_ratio/low_mean": 0.25, "clip_ratio/high_mean": 0.5, "clip_ratio/region_mean": 0.75,
        "entropy": 1.5, "kl": 0.5, "entropy_coef": 0.01,
        "sampling/importance_sampling_ratio/min": 0.5,
        "sampling/importance_sampling_ratio/mean": 1.5,
        "sampling/importance_sampling_ratio/max": 0.0,      # not finite: reported as 0
        "sampling/sampling_logp_difference/mean": 1.0,      # a count of 0 divides by 1
        "sampling/sampling_logp_difference/max": 0.25,
    }


def test_step_metrics_leave_out_what_is_off():
    metrics = step_metrics(totals_of(tokens=0, ratio_min_neg=math.inf), kl=False,
                           grad_norm=1.0, learning_rate=0.5, entropy_coef=None,
                           sampler_corrected=False)
    # no tokens: the means divide by 1
    assert metrics == {"loss": 0.5, "grad_norm": 1.0, "learning_rate": 0.5,
                       "clip_ratio/low_mean": 1.0, "clip_ratio/high_mean": 2.0,
                       "clip_ratio/region_mean": 3.0, "entropy": 6.0}
    corrected = step_metrics(totals_of(ratio_min_neg=math.inf, ratio_count=0.0, logp_diff_count=4.0,
                                       ratio_max=2.0, logp_diff_max=-math.inf),
                             kl=False, grad_norm=1.0, learning_rate=0.5, entropy_coef=None,
                             sampler_corrected=True)
    assert corrected["sampling/importance_sampling_ratio/min"] == 0.0   # -inf: 0
    assert corrected["sampling/importance_sampling_ratio/mean"] == 3.0
    assert corrected["sampling/importance_sampling_ratio/max"] == 2.0
    assert corrected["sampling/sampling_logp_difference/mean"] == 0.25
    assert corrected["sampling/sampling_logp_difference/max"] == 0.0


# ------------------------------------------------------------------------- the masks and weights


def test_no_policy_mask_when_both_are_off():
    assert policy_mask(micro(), LOGPS, ENTROPIES, config()) is None


def test_policy_mask_of_the_top_entropy_tokens():
    got = policy_mask(micro(), LOGPS, ENTROPIES, config(top_entropy_quantile=0.5))
    expected = high_entropy_mask(torch.cat(ENTROPIES), MASK, 0.5).float()
    assert torch.equal(got, expected) and got.dtype == torch.float32
    assert got.sum() < MASK.sum()   # it masks something


@pytest.mark.parametrize("source", ["sampler", "old", "policy"])
def test_off_policy_mask_takes_the_sampler_else_the_old_else_the_policy(source):
    batch = micro(sampler_logps=SAMPLER if source == "sampler" else None,
                  old_logps=None if source == "policy" else OLD)
    reference = {"sampler": SAMPLER, "old": OLD, "policy": LOGPS}[source]
    got = policy_mask(batch, LOGPS, ENTROPIES, config(off_policy_mask_threshold=0.1))
    assert torch.equal(got, off_policy_mask(ADVANTAGES, LOGPS, reference, MASK.float(), 0.1))
    # both: the product
    both = policy_mask(batch, LOGPS, ENTROPIES, config(off_policy_mask_threshold=0.1,
                                                       top_entropy_quantile=0.5))
    assert torch.equal(both, high_entropy_mask(torch.cat(ENTROPIES), MASK, 0.5).float() * got)


def test_the_off_policy_mask_differs_with_its_source():
    # the second row (A < 0): mean(sampler - policy) = (0.1 + 0.5 + 0.1) / 3 > 0.1, masked;
    # mean(old - policy) = (0.1 + 0.1 + 0) / 3 < 0.1 and the policy's own 0: kept
    args = config(off_policy_mask_threshold=0.1)
    assert policy_mask(micro(sampler_logps=SAMPLER), LOGPS, ENTROPIES, args).flatten().tolist() == [1, 0, 1]
    assert policy_mask(micro(), LOGPS, ENTROPIES, args).flatten().tolist() == [1, 1, 1]
    assert policy_mask(micro(old_logps=None), LOGPS, ENTROPIES, args).flatten().tolist() == [1, 1, 1]


def test_no_sampler_weights_without_sampler_logps():
    assert sampler_weights(micro(), LOGPS, config()) == (None, {})


@pytest.mark.parametrize("mode, clip_min, clip_max", [("token_truncate", None, 1.5),
                                                      ("sequence_mask", 0.5, 2.0),
                                                      ("token_truncate", 0.9, 1.05)])
def test_sampler_weights_and_their_stats(mode, clip_min, clip_max):
    args = config(importance_sampling_mode=mode, importance_sampling_clip_min=clip_min,
                  importance_sampling_clip_max=clip_max)
    weights, part = sampler_weights(micro(sampler_logps=SAMPLER), LOGPS, args)
    expected = sampler_importance_weights(OLD, SAMPLER, MASK, mode, clip_min, clip_max)
    assert weights.shape == LOGPS.shape and torch.equal(weights, expected.expand_as(LOGPS))
    diffs = [abs(o - s) for o_row, s_row, m_row in zip(OLD.tolist(), SAMPLER.tolist(), MASK.tolist())
             for o, s, m in zip(o_row, s_row, m_row) if m]
    assert part["logp_diff_count"] == 6.0
    assert part["logp_diff_sum"] == pytest.approx(sum(diffs), rel=1e-6)
    assert part["logp_diff_max"] == pytest.approx(max(diffs), rel=1e-6)
    ratios = expected[MASK.bool()] if mode.startswith("token") else expected.flatten()
    assert part["ratio_count"] == float(ratios.numel())
    assert part["ratio_sum"] == pytest.approx(float(ratios.sum()), rel=1e-6)
    assert part["ratio_max"] == float(ratios.max()) and part["ratio_min_neg"] == -float(ratios.min())
    assert set(part) == {"ratio_sum", "ratio_count", "logp_diff_sum", "logp_diff_count",
                         "ratio_max", "ratio_min_neg", "logp_diff_max"}
    if clip_min == 0.9:   # both bounds bite: exp(-0.4) < 0.9 and exp(0.1) > 1.05
        assert part["ratio_min_neg"] == pytest.approx(-0.9, rel=1e-6)   # float32 weights
        assert part["ratio_max"] == pytest.approx(1.05, rel=1e-6)


def test_sampler_weights_of_a_micro_batch_without_old_logps_use_the_policys():
    weights, part = sampler_weights(micro(sampler_logps=SAMPLER, old_logps=None), LOGPS,
                                    config(importance_sampling_clip_max=10.0))
    assert torch.equal(weights, sampler_importance_weights(LOGPS, SAMPLER, MASK, "token_truncate",
                                                           None, 10.0))


# ------------------------------------------------------------------------- the loss


@pytest.mark.parametrize("loss_type, level", [
    ("grpo", "token"), ("dapo", "token"), ("dr_grpo", "token"), ("bnpo", "token"),
    ("cispo", "token"), ("sapo", "token"), ("vespo", "token"), ("luspo", "sequence"),
    ("grpo", "sequence")])
def test_micro_batch_loss_is_its_terms(loss_type, level):
    args = config(loss_type=loss_type, beta=0.1, importance_sampling_level=level)
    batch = micro(ref_logps=REF)
    loss, part = run(args, batch, totals=(5, 9), num_micro=3)
    expected, stats = expected_loss(args, batch, totals=(5, 9), num_micro=3)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12)
    m = MASK.bool()
    assert part == {"kl": pytest.approx(float(stats["kl"][m].sum()), rel=1e-12),
                    "low": float(stats["is_low_clipped"][m].sum()),
                    "high": float(stats["is_high_clipped"][m].sum()),
                    "region": float(stats["is_region_clipped"][m].sum()), "tokens": 6,
                    "entropy": pytest.approx(0.5 + 1.0 + 0.25 + 2.0 + 0.75 + 1.5, rel=1e-12)}
    assert type(part["tokens"]) is int
    assert part["kl"] > 0
    # the options matter: the same batch under the default options (dapo, token level) differs
    if (loss_type, level) != ("dapo", "token"):
        default, _ = expected_loss(config(beta=0.1, loss_type="dapo"), batch, totals=(5, 9),
                                   num_micro=3)
        assert loss.item() != pytest.approx(default.item(), rel=1e-6)
    # and the loss's mask: every token (the padding's log-probs included) gives another loss
    unmasked, _ = expected_loss(args, micro(ref_logps=REF, loss_mask=torch.ones(3, 3, dtype=D)),
                                totals=(5, 9), num_micro=3)
    assert loss.item() != pytest.approx(unmasked.item(), rel=1e-6)


def test_micro_batch_loss_uses_epsilon_low_and_high():
    batch = micro()
    for low, high in ((0.2, 0.28), (0.05, 0.5), (0.5, 0.05)):
        args = config(epsilon=low, effective_epsilon_high=high)
        expected, _ = expected_loss(args, batch)
        assert run(args, batch)[0].item() == pytest.approx(expected.item(), rel=1e-12)
    assert run(config(epsilon=0.05), batch)[0].item() != run(config(epsilon=0.5), batch)[0].item()
    assert run(config(effective_epsilon_high=0.05), batch)[0].item() != \
        run(config(effective_epsilon_high=0.5), batch)[0].item()


def test_micro_batch_loss_with_sampler_weights_and_a_policy_mask():
    args = config(off_policy_mask_threshold=0.1, importance_sampling_clip_max=1.5, loss_type="dapo")
    batch = micro(sampler_logps=SAMPLER)
    loss, part = run(args, batch)
    weights, _ = sampler_weights(batch, LOGPS, args)
    mask = policy_mask(batch, LOGPS.float(), ENTROPIES, args)
    expected, _ = expected_loss(args, batch, weights=weights, mask=mask)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12)
    assert {"ratio_sum", "ratio_max", "logp_diff_max"} <= set(part)


def test_micro_batch_loss_subtracts_the_entropy_bonus():
    args = config(entropy_coef=0.5)
    batch = micro()
    loss, part = run(args, batch, coef=0.5)
    plain, _ = expected_loss(args, batch)
    bonus = entropy_bonus(torch.cat(ENTROPIES), MASK, 2)
    assert loss.item() == pytest.approx((plain - 0.5 * bonus).item(), rel=1e-12)
    assert bonus.item() == pytest.approx(6.0 / 6 / 2, rel=1e-12)
    assert part["bonus_entropy"] == 6.0 and part["bonus_tokens"] == 6.0
    # no bonus: no bonus keys
    assert "bonus_entropy" not in run(config(), batch)[1]


def test_the_entropy_bonus_is_over_the_tokens_the_policy_term_trains():
    args = config(entropy_coef=0.5, top_entropy_quantile=0.5)
    batch = micro()
    loss, part = run(args, batch, coef=0.25)
    trained = MASK * high_entropy_mask(torch.cat(ENTROPIES), MASK, 0.5)
    mask = policy_mask(batch, LOGPS.float(), ENTROPIES, args)
    plain, _ = expected_loss(args, batch, mask=mask)
    bonus = entropy_bonus(torch.cat(ENTROPIES), trained, 2)
    assert loss.item() == pytest.approx((plain - 0.25 * bonus).item(), rel=1e-12)
    kept = torch.cat(ENTROPIES)[trained.bool()]
    assert part["bonus_tokens"] == float(kept.numel()) < 6
    assert part["bonus_entropy"] == pytest.approx(float(kept.sum()), rel=1e-12)


def test_no_entropies_no_entropy_sum():
    _, part = run(config(), micro(), entropies=[])
    assert "entropy" not in part and part["tokens"] == 6
