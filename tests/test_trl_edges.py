"""Edges where cppo must match TRL exactly: zero-variance groups, bnpo's normaliser, the
importance-sampling weight on the policy term only, unpadded completion_ids for rewards, and a
max_steps that is not a multiple of num_iterations."""

import pytest
import torch

from cppo.algorithm import Objective, group_advantages, per_token_policy_loss, reduce_loss


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
@pytest.mark.parametrize("value", [0.3, 0.7, 1.0 / 3.0, 0.1])
def test_equal_non_binary_rewards_give_exactly_zero_advantage(value, scale_rewards):
    rewards = torch.tensor([[value] * 16, [0.0, 1.0] * 8])
    adv = group_advantages(rewards, scale_rewards)
    assert torch.equal(adv[0], torch.zeros(16))        # not ~1e-4: the skip must see it
    assert adv[1].abs().min() > 0.1


def test_zero_variance_non_binary_group_is_skipped():
    from cppo.algorithm import select_completions
    rewards = torch.full((2, 8), 0.3)
    adv = group_advantages(rewards, "group")
    assert not adv.any()     # the trainer's all-zero check skips such a step
    keep = select_completions(adv, rewards, num_keep=4, scope="step", rule="largest_abs")
    assert not adv[keep].any()


def test_bnpo_divides_by_the_micro_batch_tokens_and_the_accumulation_steps():
    """TRL: bnpo = sum(l * m) / m.sum() of the local micro-batch, / gradient accumulation steps;
    dapo = sum(l * m) / the whole update's tokens. They differ when micro-batches differ in tokens."""
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]], dtype=torch.float64)
    micro_a = torch.tensor([[1, 1, 1], [1, 0, 0]])     # 4 tokens, sum 10
    micro_b = torch.tensor([[1, 0, 0], [0, 0, 0]])     # 1 token, sum 1
    total_tokens = 5
    bnpo = [reduce_loss(per_token, m, "bnpo", max_completion_length=3, total_tokens=total_tokens,
                        total_sequences=4, accumulation_steps=2).item() for m in (micro_a, micro_b)]
    dapo = [reduce_loss(per_token, m, "dapo", max_completion_length=3, total_tokens=total_tokens,
                        total_sequences=4).item() for m in (micro_a, micro_b)]
    assert bnpo == pytest.approx([10 / 4 / 2, 1 / 1 / 2])
    assert dapo == pytest.approx([10 / 5, 1 / 5])
    assert sum(bnpo) != pytest.approx(sum(dapo))


def test_trainer_passes_the_accumulation_steps_to_bnpo(tiny_model_dir, tmp_path, monkeypatch):
    """Two micro-batches per update: each bnpo micro-loss is its own token mean / 2."""
    import cppo.algorithm.micro_batch as micro_batch
    from helpers import make_trainer
    seen = []
    reduce = micro_batch.reduce_loss

    def spy(per_token, mask, loss_type, **kw):
        seen.append((reduce(per_token, mask, loss_type, **kw).item(),
                     reduce(per_token, mask, "bnpo", max_completion_length=5).item()))
        return reduce(per_token, mask, loss_type, **kw)
    monkeypatch.setattr(micro_batch, "reduce_loss", spy)
    trainer = make_trainer(tiny_model_dir, tmp_path / "run", max_steps=1, loss_type="bnpo",
                           per_device_train_batch_size=4, gradient_accumulation_steps=2,
                           pruning_rate=0.0, eval_num_questions=1, save_steps=0)
    trainer.train()
    assert len(seen) == 2
    for micro, own_mean in seen:
        assert micro == pytest.approx(own_mean / 2, rel=1e-6)


def test_sampling_weights_multiply_the_policy_term_not_the_kl():
    g = torch.Generator().manual_seed(0)
    logps = -torch.rand(3, 4, generator=g, dtype=torch.float64)
    ref = logps - 0.2 * torch.rand(3, 4, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    w = 0.5 + torch.rand(3, 4, generator=g, dtype=torch.float64)
    objective, kw = Objective(epsilon_low=0.2, epsilon_high=0.2), dict(beta=0.04, ref_logps=ref)
    plain, stats = per_token_policy_loss(logps, None, adv, objective, **kw)
    weighted, _ = per_token_policy_loss(logps, None, adv, objective, sampling_weights=w, **kw)
    policy_term = plain - 0.04 * stats["kl"]
    torch.testing.assert_close(weighted, w * policy_term + 0.04 * stats["kl"])


def test_trainer_does_not_weight_the_kl_term(tiny_model_dir, tmp_path, monkeypatch):
    """With a bfloat16 sampler (importance weights) and beta > 0, the per-token loss the trainer
    reduces is exactly the one per_token_policy_loss returned (weights applied inside, on the
    policy term only), not that loss multiplied by the weights afterwards."""
    import cppo.algorithm.micro_batch as micro_batch
    from helpers import make_trainer
    made, reduced = [], []
    policy_loss, reduce = micro_batch.per_token_policy_loss, micro_batch.reduce_loss

    def spy_policy(*args, **kw):
        out = policy_loss(*args, **kw)
        made.append((out[0].detach().clone(), kw.get("sampling_weights")))
        return out

    def spy_reduce(per_token, *args, **kw):
        reduced.append(per_token.detach().clone())
        return reduce(per_token, *args, **kw)
    monkeypatch.setattr(micro_batch, "per_token_policy_loss", spy_policy)
    monkeypatch.setattr(micro_batch, "reduce_loss", spy_reduce)
    trainer = make_trainer(tiny_model_dir, tmp_path / "run", max_steps=1, beta=0.1,
                           generation_dtype="bfloat16", eval_num_questions=1, save_steps=0)
    trainer.train()
    assert made and len(made) == len(reduced)
    for (per_token, weights), seen in zip(made, reduced):
        assert weights is not None
        assert torch.equal(per_token, seen)


def test_rewards_receive_unpadded_completion_ids(tiny_model_dir, tmp_path):
    """TRL hands reward functions completion_ids as unpadded lists: len(ids) is the real length
    (up to and including EOS), and it matches the decoded text's tokens."""
    from helpers import make_trainer
    calls = []

    def length_of_ids(prompts, completions, completion_ids, **kw):
        calls.append([list(c) for c in completion_ids])
        return [float(len(c) % 2) for c in completion_ids]
    trainer = make_trainer(tiny_model_dir, tmp_path / "run", reward=length_of_ids, max_steps=1,
                           max_completion_length=6, eval_num_questions=1, save_steps=0)
    rows, _, _ = trainer.take_questions()
    _, completions = trainer.generate(rows)
    calls.clear()
    trainer.score(rows, completions)
    (ids,) = calls
    lengths = completions.mask.sum(1).tolist()
    assert [len(c) for c in ids] == lengths
    assert any(n < completions.ids.shape[1] for n in lengths)   # some completion ended early
    pad = trainer.tokenizer.pad_token_id
    for c, row, n in zip(ids, completions.ids.tolist(), lengths):
        assert c == row[:n]
        assert all(t == pad for t in row[n:])


def test_reward_runner_refuses_a_padded_tensor():
    from cppo.rewards.runner import RewardRunner
    runner = RewardRunner([lambda prompts, completions, completion_ids, **kw: [0.0] * len(prompts)])
    with pytest.raises(TypeError, match="unpadded lists"):
        runner([{"prompt": "p"}], ["a", "b"], torch.zeros(2, 3, dtype=torch.long), 2)


@pytest.mark.parametrize("max_steps", [3, 5])
def test_max_steps_not_a_multiple_of_num_iterations(tiny_model_dir, tmp_path, max_steps):
    """mu = 2 and an odd max_steps: the run stops at max_steps exactly and the cosine rate never
    rises again (it would past the schedule's end)."""
    import json
    from helpers import make_trainer
    trainer = make_trainer(tiny_model_dir, tmp_path / "run", max_steps=max_steps, num_iterations=2,
                           lr_scheduler_type="cosine", eval_num_questions=1, save_steps=0)
    summary = trainer.train()
    assert summary["steps"] == max_steps == trainer.run_state.step
    assert trainer.scheduler.last_epoch == max_steps
    rates = [json.loads(line)["learning_rate"]
             for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
             if "learning_rate" in json.loads(line)]
    assert rates == sorted(rates, reverse=True)
    assert trainer.scheduler.get_last_lr()[0] == pytest.approx(0.0, abs=1e-12)
