"""What CPPO's selection keeps when the objective is sequence-level or entropy-masked
(docs/objectives.md, "With completion pruning"): whole completions, whose sequence ratios are the
ones they have without pruning; entropy quantiles over the kept tokens; normalisers that count
what is kept."""

import pytest
import torch

from cppo.algorithm import (gamma_weights, high_entropy_mask, importance_ratio, off_policy_mask,
                            reduce_loss)


def batch(seed=0, n=8, t=6):
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(n, t, generator=g, dtype=torch.float64)
    old = logps - 0.3 * torch.randn(n, t, generator=g, dtype=torch.float64)
    lengths = torch.tensor([1, 3, 6, 2, 4, 6, 5, 1])[:n]
    mask = torch.arange(t)[None] < lengths[:, None]
    return logps, old, mask


def test_a_kept_completions_sequence_ratio_and_weight_are_those_without_pruning():
    logps, old, mask = batch()
    keep = torch.tensor([0, 2, 5, 6])
    adv = torch.linspace(-1, 1, 8, dtype=torch.float64)
    full = importance_ratio(logps, old, mask, "sequence")
    torch.testing.assert_close(importance_ratio(logps[keep], old[keep], mask[keep], "sequence"),
                               full[keep], rtol=0, atol=0)
    phi = gamma_weights(adv[:, None], logps - old, mask)
    torch.testing.assert_close(gamma_weights(adv[keep, None], (logps - old)[keep], mask[keep]),
                               phi[keep], rtol=0, atol=0)
    opm = off_policy_mask(adv, logps, old, mask, 0.05)
    assert torch.equal(off_policy_mask(adv[keep], logps[keep], old[keep], mask[keep], 0.05), opm[keep])


def test_the_entropy_quantile_is_over_the_kept_tokens():
    g = torch.Generator().manual_seed(1)
    _, _, mask = batch()
    entropies = torch.rand(8, 6, generator=g) * mask   # 0 at padding, as the trainer gives them
    keep = torch.tensor([1, 2, 4, 5])
    kept = high_entropy_mask(entropies[keep], mask[keep], 0.25)
    pool = entropies[keep][mask[keep]]
    assert kept.sum() == (pool >= torch.quantile(pool, 0.75)).sum()
    assert not (kept & ~mask[keep]).any()
    # the same tokens ranked among every completion's tokens can give another set: pinned as is
    assert high_entropy_mask(entropies, mask, 0.25)[keep].sum() != kept.sum()


@pytest.mark.parametrize("loss_type", ["grpo", "sapo", "luspo", "dapo", "cispo", "vespo",
                                       "dr_grpo"])
def test_normalisers_count_the_kept_completions(loss_type):
    """4 kept completions of 1, 6, 6 and 5 tokens (18 in all)."""
    _, _, mask = batch()
    mask = mask[torch.tensor([0, 2, 5, 6])]
    per_token = torch.randn(4, 6, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    sums = (per_token * mask).sum(1)
    expected = {"grpo": (sums / mask.sum(1)).sum() / 4, "sapo": (sums / mask.sum(1)).sum() / 4,
                "luspo": sums.sum() / 4, "dapo": sums.sum() / 18, "cispo": sums.sum() / 18,
                "vespo": sums.sum() / 18, "dr_grpo": sums.sum() / (4 * 6)}[loss_type]
    loss = reduce_loss(per_token, mask, loss_type, max_completion_length=6)
    assert loss.item() == pytest.approx(expected.item())


@pytest.mark.parametrize("options", [dict(importance_sampling_level="sequence", loss_type="grpo"),
                                     dict(top_entropy_quantile=0.5),
                                     dict(off_policy_mask_threshold=0.0, num_iterations=2)])
def test_the_trainer_runs_every_objective_on_the_kept_completions_only(tiny_model_dir, tmp_path,
                                                                       monkeypatch, options):
    """pruning_rate 0.5: each micro-batch's loss, entropy mask and sequence ratios see the kept
    rows only (8 of 16 scored), and entropies exist for those rows only."""
    import cppo.algorithm.micro_batch as micro_batch
    from helpers import make_trainer
    rows_seen, masked = [], []
    loss, entropy_mask = micro_batch.per_token_policy_loss, micro_batch.high_entropy_mask

    def spy_loss(logps, *a, **kw):
        rows_seen.append(logps.shape[0])
        assert kw["completion_mask"].shape == logps.shape
        return loss(logps, *a, **kw)

    def spy_mask(entropies, mask, q):
        masked.append((entropies.shape[0], int(mask.sum())))
        return entropy_mask(entropies, mask, q)
    monkeypatch.setattr(micro_batch, "per_token_policy_loss", spy_loss)
    monkeypatch.setattr(micro_batch, "high_entropy_mask", spy_mask)
    trainer = make_trainer(tiny_model_dir, tmp_path / "run", max_steps=2, save_steps=0,
                           eval_num_questions=1, **options)
    trainer.train()
    assert rows_seen and set(rows_seen) <= {trainer.plan.completions_kept}
    assert trainer.plan.completions_kept < trainer.plan.questions_per_step * 4
    if "top_entropy_quantile" in options:
        assert masked and all(rows == trainer.plan.completions_kept for rows, _ in masked)
