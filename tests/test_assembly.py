"""A run built from parts (cppo.assembly): each part works without a trainer, the trainer is the
facade over exactly the parts build_run made, and a round run by hand on the parts equals the
trainer's round."""

import pytest
import torch

from cppo.algorithm.advantages import round_advantages
from cppo.assembly import Selector, build_run
from cppo.config import CPPOConfig
from cppo.models import load_model, load_tokenizer
from cppo.parallel.processes import Distributed
from cppo.run import checkpoint as ckpt
from cppo.run.batch import kept_batch
from helpers import ROWS, make_trainer, odd_length_reward

SETTINGS = dict(max_steps=4, per_device_train_batch_size=8, num_generations=4, pruning_rate=0.5,
                max_completion_length=5, eval_steps=0, save_steps=2, progress_bar=False,
                eval_num_questions=4, learning_rate=1e-3, seed=3, log_completions=False)


def parts_of(model_dir, output_dir, **overrides):
    """build_run with make_trainer's arguments (the same run, without the trainer)."""
    cfg = CPPOConfig(model=model_dir, output_dir=str(output_dir), **{**SETTINGS, **overrides})
    return build_run(cfg, model=load_model(model_dir), processing_class=load_tokenizer(model_dir),
                     reward_funcs=[odd_length_reward], train_dataset=ROWS, eval_dataset=ROWS[:4])


def round_by_hand(parts) -> tuple[torch.Tensor, dict]:
    """One round on the parts alone: questions, completions, rewards, advantages, selection, the
    kept batch, old-policy log-probs and one optimizer step. Returns keep_mask and the step's
    metrics."""
    g = parts.generation.num_generations
    rows = [parts.task.train_rows[i] for i in parts.questions.take(parts.plan.questions_per_step)]
    prompts, completions = parts.generation.sample(rows, round_index=0)
    scores = parts.rewards.score(parts.models.tokenizer, rows, completions, g)
    advantages = round_advantages(scores.rewards, scores.per_function, parts.rewards.weights,
                                  aggregation="sum_then_normalize", scale_rewards="group",
                                  gather=parts.dist.gather)
    keep = parts.selector.keep_mask(advantages, scores.rewards, round_index=0)
    batch = kept_batch(prompts, completions, parts.selector.loss_advantages(advantages, keep, completions),
                       keep, num_generations=g, mask_truncated=False, sampler_logprobs=False)
    parts.learner.fill_old_and_ref_logprobs(batch)
    return keep, parts.learner.step(batch, 0.0, None)


def test_a_round_by_hand_on_the_parts_equals_the_trainers_round(tiny_model_dir, tmp_path):
    parts = parts_of(tiny_model_dir, tmp_path / "parts")
    before = [p.detach().clone() for p in parts.models.policy.parameters()]
    keep, metrics = round_by_hand(parts)
    assert int(keep.sum()) == parts.plan.completions_kept == 8
    assert any(not torch.equal(a, b) for a, b in zip(before, parts.models.policy.parameters()))

    trainer = make_trainer(tiny_model_dir, tmp_path / "trainer")
    trained = trainer.training_round()
    assert trained["loss"] == pytest.approx(metrics["loss"], rel=1e-6, abs=1e-9)
    for mine, its in zip(parts.models.policy.parameters(), trainer.policy.parameters()):
        torch.testing.assert_close(mine, its, rtol=0, atol=0)


def test_the_trainer_is_the_facade_over_the_parts(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path)
    assert trainer.generation.backend is trainer.backend
    assert trainer.learner.optimizer is trainer.optimizer and trainer.learner.policy is trainer.policy
    assert trainer.checkpointer.model is trainer.policy
    assert trainer.checkpointer.optimizer is trainer.optimizer
    assert trainer.checkpointer.scheduler is trainer.scheduler
    assert trainer.selector.plan == trainer.plan and trainer.selector.dist is trainer.dist
    assert trainer.checkpointer.keep == trainer.args.save_total_limit


def selector(rule="largest_abs", rate=0.5, scope="step", loss_type="dapo", seed=0):
    plan = CPPOConfig(num_generations=4, pruning_rate=rate, per_device_train_batch_size=8,
                      selection_rule=rule, selection_scope=scope).step_plan()
    return Selector(rule, scope, rate, plan, 4, seed, loss_type, False,
                    Distributed.from_environment())


def test_the_selector_keeps_the_plans_count_of_the_largest_advantages():
    advantages = torch.tensor([[3.0, -1.0, 0.5, -2.5], [0.1, 0.2, -4.0, 0.0],
                               [1.5, -0.3, 0.7, 2.0], [-0.6, 0.4, 0.9, -1.2]])
    keep = selector().keep_mask(advantages, advantages, round_index=0)
    assert int(keep.sum()) == 8
    assert sorted(advantages[keep].abs().tolist()) == sorted(advantages.abs().flatten().tolist())[-8:]
    assert selector(rate=0.0).keep_mask(advantages, advantages, 0).all()


def test_a_random_rule_draws_per_round_and_seed():
    advantages = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))
    masks = {(r, s): selector("random", seed=s).keep_mask(advantages, advantages, r)
             for r in (0, 1) for s in (0, 1)}
    assert torch.equal(masks[0, 0], selector("random").keep_mask(advantages, advantages, 0))
    assert not torch.equal(masks[0, 0], masks[1, 0])   # another round
    assert not torch.equal(masks[0, 0], masks[0, 1])   # another seed


def test_only_a_reweighting_rule_changes_the_loss_advantages():
    from cppo.sampling.batches import Completions
    advantages = torch.tensor([[3.0, -1.0, 0.5, -2.5], [0.1, 0.2, -4.0, 0.0]], dtype=torch.float64)
    keep = torch.tensor([[True, False, False, True], [False, False, True, True]])
    ids = torch.ones(8, 3, dtype=torch.long)
    completions = Completions(ids=ids, mask=torch.ones_like(ids), truncated=torch.zeros(8, dtype=torch.bool))
    assert selector().loss_advantages(advantages, keep, completions) is advantages
    weighted = selector("unbiased").loss_advantages(advantages, keep, completions)
    from cppo.algorithm.inclusion import inclusion_probabilities
    pi = inclusion_probabilities(advantages, num_keep=4, scope="step")
    torch.testing.assert_close(weighted, advantages * 0.5 / pi, rtol=1e-12, atol=1e-12)


def test_the_checkpointer_saves_and_loads_back(tiny_model_dir, tmp_path):
    parts = parts_of(tiny_model_dir, tmp_path)
    saver, policy, learner = parts.checkpointer, parts.models.policy, parts.learner
    assert saver.to_resume(resume=False, restarts=0) is None
    assert saver.to_resume(resume=True, restarts=0) is None   # nothing saved yet
    round_by_hand(parts)   # the optimizer and the schedule have a state
    state = ckpt.RunState()
    state.step = 3
    saved = [p.detach().clone() for p in policy.parameters()]
    moments = [s["exp_avg"].clone() for s in learner.optimizer.state.values()]
    schedule = learner.scheduler.state_dict()
    path = saver.save(3, state.to_dict(config={}, world_size=1, distributed="none"))
    assert path is not None and saver.to_resume(resume=True, restarts=0) == path
    assert saver.to_resume(resume=False, restarts=1) == path   # a restart by the launcher
    round_by_hand(parts)   # parameters, moments and schedule move on
    loaded = saver.load(path)
    assert loaded.step == 3
    for a, b in zip(saved, policy.parameters()):
        assert torch.equal(a, b)
    for a, s in zip(moments, learner.optimizer.state.values()):
        assert torch.equal(a, s["exp_avg"])
    assert learner.scheduler.state_dict() == schedule
