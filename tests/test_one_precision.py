"""Every pass of a step runs at one precision: with bf16 on, the old-policy, reference and policy
log-probs come from the same autocast, so the first iteration's ratio is exactly 1 and the KL to a
reference equal to the policy is exactly 0."""

import pytest
import torch

import cppo.trainer as trainer_module
from helpers import make_trainer


@pytest.mark.parametrize("lean_forward", [True, False])
def test_bf16_first_iteration_ratio_is_one_and_kl_is_zero(tiny_model_dir, tmp_path, monkeypatch,
                                                           lean_forward):
    calls = []
    policy_loss = trainer_module.per_token_policy_loss

    def spy(logps, old_logps, advantages, **kw):
        calls.append((logps.detach().clone(), old_logps.clone(), kw["ref_logps"].clone()))
        return policy_loss(logps, old_logps, advantages, **kw)
    monkeypatch.setattr(trainer_module, "per_token_policy_loss", spy)
    trainer = make_trainer(tiny_model_dir, tmp_path / "run", max_steps=2, num_iterations=2, beta=0.04,
                           bf16=True, lean_forward=lean_forward, per_device_train_batch_size=4,
                           gradient_accumulation_steps=2, eval_num_questions=1, save_steps=0)
    metrics = trainer.training_round()
    assert len(calls) == 4                  # 2 iterations x 2 micro-batches
    for logps, old, ref in calls[:2]:       # first iteration: nothing has moved yet
        assert torch.equal(logps, old)      # ratio exactly 1
        assert torch.equal(logps, ref)      # KL exactly 0
    assert not torch.equal(calls[2][0], calls[2][1])   # the second iteration did move
    assert metrics["kl"] > 0   # mean over both iterations: the second one is off the reference


def test_bf16_passes_differ_from_fp32_ones(tiny_model_dir, tmp_path):
    """The check above would be empty if bf16 autocast changed nothing on this model."""
    trainer = make_trainer(tiny_model_dir, tmp_path / "run", max_steps=1, bf16=True, beta=0.04,
                           eval_num_questions=1, save_steps=0)
    rows = trainer.take_questions()
    prompts, completions = trainer.generate(rows)
    keep = torch.ones(len(rows), trainer.args.num_generations, dtype=torch.bool)
    batch = trainer.build_batch(prompts, completions, torch.ones(keep.shape), keep)
    with torch.no_grad():
        fp32 = trainer.logprobs(trainer.policy, batch)
        with trainer.autocast():
            bf16 = trainer.logprobs(trainer.policy, batch)
    assert not torch.equal(fp32, bf16)
