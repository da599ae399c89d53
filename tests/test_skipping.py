"""Zero-variance prompt skipping: the rule, the trainer's draw, its metrics and its checkpointed
history."""

import json

import pytest
import torch

from cppo.algorithm.skipping import keep_probability, updated_streaks, zero_variance_groups
from cppo.config import CPPOConfig
from cppo.errors import ConfigError
from helpers import ROWS, make_trainer, odd_length_reward

CONSTANT = {r["prompt"] for r in ROWS if int(r["prompt"][:2]) < 5}   # 30 of the 60 questions


def half_constant_reward(prompts, completions, completion_ids=None, **kw):
    """1 for every completion of the CONSTANT questions (zero variance, always); elsewhere
    odd_length_reward (varied)."""
    varied = odd_length_reward(prompts, completions)
    return [1.0 if p in CONSTANT else v for p, v in zip(prompts, varied)]


def test_rule():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.5, 0.5, 0.5]])
    assert zero_variance_groups(rewards).tolist() == [True, False, True]
    assert updated_streaks(torch.tensor([0, 3, 2]), torch.tensor([True, False, True])).tolist() == [1, 0, 3]
    probs = keep_probability(torch.tensor([0, 1, 2, 5]), floor=0.1)
    assert probs.tolist() == [1.0, 0.5, 0.25, 0.1]    # never below the floor


def _run(tiny_model_dir, path, **overrides):
    values = dict(reward=half_constant_reward, max_steps=30, save_steps=0,
                  skip_zero_variance_prompts=True)
    values.update(overrides)
    trainer = make_trainer(tiny_model_dir, path, **values)
    seen = []
    take = trainer.take_questions

    def recording_take():
        rows, order, skipped = take()
        seen.append([r["prompt"] for r in rows])
        return rows, order, skipped
    trainer.take_questions = recording_take
    trainer.train()
    records = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    return trainer, seen, [r for r in records if "cppo/skipped_prompts" in r]


def test_questions_without_variance_are_skipped_after_their_first_group(tiny_model_dir, tmp_path):
    # 30 steps x 4 questions: two passes over the 60; the first sees every question once
    trainer, seen, records = _run(tiny_model_dir, tmp_path / "run")
    first_pass = [p for step in seen[:15] for p in step]
    assert sorted(first_pass) == sorted(r["prompt"] for r in ROWS)     # nothing skipped unseen
    streaks = {ROWS[int(i)]["prompt"]: s
               for i, s in trainer.features.get("prompt_skipping").streaks.items()}
    assert all(streaks.get(p, 0) >= 1 for p in CONSTANT)   # every group of theirs had zero variance
    skipped = sum(r["cppo/skipped_prompts"] for r in records)
    assert skipped > 0 and trainer.run_state.counters["prompts_skipped"] == skipped
    assert all(r["cppo/skipped_completions"] == 4 * r["cppo/skipped_prompts"] for r in records)
    # the freed budget went to other questions: every step still rolled out 4
    assert all(len(step) == 4 for step in seen)
    later = [p for step in seen[15:] for p in step]
    assert sum(p in CONSTANT for p in later) < sum(p not in CONSTANT for p in later)


def test_the_exploration_floor_bounds_skipping(tiny_model_dir, tmp_path):
    _, _, records = _run(tiny_model_dir, tmp_path / "run", skip_exploration_floor=1.0, max_steps=20)
    assert sum(r["cppo/skipped_prompts"] for r in records) == 0
    with pytest.raises(ConfigError, match="'skip_exploration_floor' is 0"):
        CPPOConfig(skip_exploration_floor=0)


def test_streaks_are_checkpointed_and_resumed(tiny_model_dir, tmp_path):
    kw = dict(reward=half_constant_reward, max_steps=20, skip_zero_variance_prompts=True, save_steps=0)
    straight = make_trainer(tiny_model_dir, tmp_path / "a", **kw)
    straight.train()
    interrupted = make_trainer(tiny_model_dir, tmp_path / "b", **kw)
    real_round = interrupted.training_round

    def round_then_ctrl_c():
        metrics = real_round()
        if interrupted.run_state.step == 17:
            interrupted.stop_requested = True
        return metrics
    interrupted.training_round = round_then_ctrl_c
    assert interrupted.train()["status"] == "interrupted"
    state = json.loads((tmp_path / "b" / "checkpoint-17" / "trainer_state.json").read_text())
    saved = state["features"]["prompt_skipping"]["streaks"]
    assert saved == interrupted.features.get("prompt_skipping").streaks and saved
    resumed = make_trainer(tiny_model_dir, tmp_path / "b", resume=True, **kw)
    resumed.train()
    assert resumed.features.get("prompt_skipping").streaks == \
        straight.features.get("prompt_skipping").streaks
    assert resumed.run_state.counters == straight.run_state.counters
