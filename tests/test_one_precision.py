"""Every pass of a step runs at one precision: with bf16 on (or matmul_dtype bfloat16), the
old-policy, reference and policy log-probs come from the same autocast (the same bfloat16 Linear
matmuls), so the first iteration's ratio is exactly 1 and the KL to a reference equal to the
policy is exactly 0."""

import pytest
import torch

import cppo.learning.update as update_module

import cppo.algorithm.micro_batch as micro_batch
from helpers import make_trainer

pytestmark = pytest.mark.cpu_paths   # two code paths compared: tests/test_cpu_paths.py


@pytest.mark.parametrize("lean_forward,precision", [(True, {"bf16": True}), (False, {"bf16": True}),
                                                    (True, {"matmul_dtype": "bfloat16"})])
def test_bf16_first_iteration_ratio_is_one_and_kl_is_zero(tiny_model_dir, tmp_path, monkeypatch,
                                                           lean_forward, precision):
    calls = []
    policy_loss = micro_batch.per_token_policy_loss

    def spy(logps, old_logps, advantages, objective, **kw):
        calls.append((logps.detach().clone(), old_logps.clone(), kw["ref_logps"].clone()))
        return policy_loss(logps, old_logps, advantages, objective, **kw)
    monkeypatch.setattr(micro_batch, "per_token_policy_loss", spy)
    trainer = make_trainer(tiny_model_dir, tmp_path / "run", max_steps=2, num_iterations=2, beta=0.04,
                           **precision, lean_forward=lean_forward, per_device_train_batch_size=4,
                           gradient_accumulation_steps=2, eval_num_questions=1, save_steps=0)
    metrics = trainer.training_round()
    assert len(calls) == 4                  # 2 iterations x 2 micro-batches
    for logps, old, ref in calls[:2]:       # first iteration: nothing has moved yet
        assert torch.equal(logps, old)      # ratio exactly 1
        assert torch.equal(logps, ref)      # KL exactly 0
    assert not torch.equal(calls[2][0], calls[2][1])   # the second iteration did move
    assert metrics["kl"] > 0   # mean over both iterations: the second one is off the reference


def _one_batch(trainer):
    """One step's questions, sampled and kept whole: a batch for the passes to score."""
    rows, _, _ = trainer.take_questions()
    prompts, completions = trainer.generate(rows)
    keep = torch.ones(len(rows), trainer.args.num_generations, dtype=torch.bool)
    return trainer.build_batch(prompts, completions, torch.ones(keep.shape), keep)


def test_bf16_passes_differ_from_fp32_ones(tiny_model_dir, tmp_path):
    """The check above would be empty if bf16 autocast changed nothing on this model."""
    trainer = make_trainer(tiny_model_dir, tmp_path / "run", max_steps=1, bf16=True, beta=0.04,
                           eval_num_questions=1, save_steps=0)
    batch = _one_batch(trainer)
    with torch.no_grad():
        fp32 = trainer.learner.logprobs(trainer.policy, batch)
        with trainer.learner.autocast():
            bf16 = trainer.learner.logprobs(trainer.policy, batch)
    assert not torch.equal(fp32, bf16)


def test_matmul_dtype_passes_differ_from_fp32_ones_and_reach_every_pass(tiny_model_dir, tmp_path,
                                                                         monkeypatch):
    """matmul_dtype bfloat16 changes the policy's log-probs (so the check above is not empty), and
    the trainer asks for it in the policy's and the reference's passes alike."""
    asked = []
    logprobs_of = update_module.completion_logprobs

    def spy(model, *args, **kw):
        asked.append(kw["forward"].matmul_dtype)
        return logprobs_of(model, *args, **kw)
    monkeypatch.setattr(update_module, "completion_logprobs", spy)
    trainer = make_trainer(tiny_model_dir, tmp_path / "run", max_steps=1, beta=0.04,
                           matmul_dtype="bfloat16", eval_num_questions=1, save_steps=0)
    batch = _one_batch(trainer)
    with torch.no_grad():
        bf16 = trainer.learner.logprobs(trainer.policy, batch)
        trainer.learner.matmul_dtype = None
        fp32 = trainer.learner.logprobs(trainer.policy, batch)
    assert not torch.equal(fp32, bf16)
    torch.testing.assert_close(bf16, fp32, atol=0.05, rtol=0)   # rounding, not another function
    trainer.learner.matmul_dtype = "bfloat16"
    asked.clear()
    trainer.training_round()
    assert len(asked) >= 2 and set(asked) == {torch.bfloat16}   # reference and policy passes
