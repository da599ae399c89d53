"""Two-stage draw (two_stage_generations): the rule, the trainer's two stages, its metrics, and
the combinations it refuses."""

import json

import pytest
import torch

from cppo.algorithm.allocation import plan_step
from cppo.algorithm.two_stage import balanced_continued, completions_to_keep, continued_questions
from cppo.config import CPPOConfig
from cppo.errors import ConfigError
from helpers import make_trainer
from test_skipping import CONSTANT, half_constant_reward


def test_rule_continues_varied_questions_and_explores_the_rest():
    rewards = torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.5, 0.5], [0.0, 0.0]])
    draws = torch.tensor([0.9, 0.9, 0.05, 0.5], dtype=torch.float64)
    assert continued_questions(rewards, draws, 0.1).tolist() == [False, True, True, False]
    assert continued_questions(rewards, draws, 0.0).tolist() == [False, True, False, False]
    assert continued_questions(rewards, draws, 1.0).all()


def test_exploration_probability_is_honoured():
    gen = torch.Generator().manual_seed(0)
    n = 20_000
    draws = torch.rand(n, generator=gen, dtype=torch.float64)
    for p in (0.1, 0.3):
        share = continued_questions(torch.ones(n, 2), draws, p).float().mean().item()
        assert abs(share - p) < 0.015, (p, share)   # 4+ standard errors at n = 20k


def test_every_process_continues_the_same_number():
    keep = torch.tensor([[True, True, False, False], [False, False, False, False]])
    draws = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.9, 0.2, 0.5, 0.8]], dtype=torch.float64)
    out = balanced_continued(keep, draws)
    assert out.tolist() == [[True, True, False, False], [False, True, True, False]]
    none = balanced_continued(torch.zeros(1, 3, dtype=torch.bool), torch.tensor([[0.5, 0.1, 0.7]]))
    assert none.tolist() == [[False, True, False]]     # at least one question per step


def test_completions_kept_for_fewer_questions():
    step = plan_step(completions_per_update=8, group_size=4, pruning_rate=0.5, allocation=True,
                     scope="step")
    assert (step.questions_per_step, step.completions_kept) == (4, 8)
    assert [completions_to_keep(step, q, 4) for q in (4, 3, 1)] == [8, 8, 4]
    question = plan_step(completions_per_update=8, group_size=4, pruning_rate=0.5,
                         allocation=True, scope="question")
    assert [completions_to_keep(question, q, 4) for q in (4, 3, 1)] == [8, 6, 2]


def test_trainer_drops_questions_after_the_first_stage(tiny_model_dir, tmp_path):
    k, G = 2, 4
    trainer = make_trainer(tiny_model_dir, tmp_path / "run", reward=half_constant_reward,
                           max_steps=8, save_steps=0, two_stage_generations=k,
                           two_stage_exploration=0.0)
    calls, firsts, results = [], [], []
    generate, score, two_stage = trainer.backend.generate, trainer.score, trainer.generate_two_stage

    def spy_generate(prompts, **kw):
        out = generate(prompts, **kw)
        calls.append((len(prompts), kw.get("num_generations"), out))
        return out

    def spy_score(rows, completions, group_size=None):
        out = score(rows, completions, group_size=group_size)
        if group_size == k:   # the first stage's k completions per question
            firsts.append(([r["prompt"] for r in rows], out.rewards))
        return out

    def spy_two_stage(rows):
        out = two_stage(rows)
        results.append(([r["prompt"] for r in rows], out))
        return out
    trainer.backend.generate, trainer.score = spy_generate, spy_score
    trainer.generate_two_stage = spy_two_stage
    trainer.train()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "cppo/two_stage_dropped" in r]
    assert len(results) == 8 and len(calls) == 16
    total_dropped = 0
    for step, ((prompts, first_rewards), (asked, draw)) in enumerate(zip(firsts, results)):
        kept_rows, completions = draw.rows, draw.completions
        assert calls[2 * step][:2] == (4, k) and calls[2 * step + 1][1] == G - k
        first = calls[2 * step][2]
        kept = [r["prompt"] for r in kept_rows]
        varied = [p for p, r in zip(prompts, first_rewards) if not (r == r[0]).all()]
        assert kept == (varied or kept[:1]) and len(kept) >= 1   # no exploration: varied only
        assert not set(kept) & CONSTANT or kept == kept[:1] and not varied
        assert completions.ids.shape[0] == G * len(kept)          # exactly G per kept question
        width = first.ids.shape[1]
        for j, p in enumerate(kept):                                # the first stage's, reused
            i = prompts.index(p)
            reused = completions.ids[j * G:j * G + k]
            assert torch.equal(reused[:, :width], first.ids[i * k:(i + 1) * k])
            assert (reused[:, width:] == trainer.tokenizer.pad_token_id).all()
        total_dropped += 4 - len(kept)
    assert total_dropped > 0
    assert sum(r["cppo/two_stage_dropped"] for r in records) == total_dropped
    assert trainer.run_state.counters["two_stage_dropped"] == total_dropped
    assert all(r["cppo/two_stage_saved_completions"] == (G - k) * r["cppo/two_stage_dropped"]
               and r["cppo/completions_scored"] == G * r["cppo/questions_per_step"] for r in records)


def test_refused_combinations(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="'two_stage_generations' is 4 with 'num_generations' 4"):
        CPPOConfig(num_generations=4, two_stage_generations=4)
    with pytest.raises(ConfigError, match="'two_stage_generations' must be a|'two_stage_generations' is -1"):
        CPPOConfig(two_stage_generations=-1)
    with pytest.raises(ConfigError, match="'two_stage_generations' is 2, which applies to the built-in"):
        CPPOConfig(num_generations=4, two_stage_generations=2, use_vllm=True)
    with pytest.raises(ConfigError, match="'skip_zero_variance_prompts' true"):
        CPPOConfig(num_generations=4, two_stage_generations=2, skip_zero_variance_prompts=True)
    with pytest.raises(ConfigError, match="'two_stage_exploration' is 1.5"):
        CPPOConfig(two_stage_exploration=1.5)
    from cppo.trainer import CPPOTrainer
    with pytest.raises(ConfigError, match="'two_stage_generations' is 2, .*rollout_func"):
        CPPOTrainer(model=tiny_model_dir, reward_funcs=[half_constant_reward],
                    args=CPPOConfig(num_generations=4, two_stage_generations=2,
                                    output_dir=str(tmp_path)),
                    rollout_func=lambda prompts, trainer: {})
