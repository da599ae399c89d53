"""The optional parts of a run as objects (cppo.features): which ones a config turns on, each
one's hooks and state, and a checkpoint written before features were saved by name."""

import math

import pytest
import torch

from cppo.config import CPPOConfig
from cppo.config.sections import LossSection, PruningSection, SamplingSection
from cppo.data.questions import QuestionStream
from cppo.features import (FP16Scaling, Features, PromptSkipping, build_features,
                           states_of_old_checkpoint)
from cppo.errors import ConfigError


def names(features: Features) -> list[str]:
    return sorted(features.by_name)


def features_of(config: CPPOConfig, fp16: FP16Scaling | None = None) -> Features:
    """build_features on the config's sections, as cppo.assembly.run calls it."""
    return build_features(LossSection.of(config), PruningSection.of(config),
                          SamplingSection.of(config), fp16=fp16)


def built(name: str, **fields):
    """The feature `name` as build_features makes it from a config with `fields`."""
    return features_of(CPPOConfig.from_dict(fields)).get(name)


def test_the_config_turns_features_on():
    assert names(features_of(CPPOConfig())) == []
    cfg = CPPOConfig.from_dict({"use_adaptive_entropy": True, "skip_zero_variance_prompts": True})
    assert names(features_of(cfg)) == ["adaptive_entropy", "prompt_skipping"]
    cfg = CPPOConfig.from_dict({"pruning_rate": "auto", "async_rollout": True})
    assert names(features_of(cfg)) == ["auto_pruning"]
    fp16 = FP16Scaling(torch.device("cpu"))
    assert features_of(CPPOConfig(), fp16=fp16).get("fp16_scaling") is fp16
    assert "fp16_scaling" not in features_of(CPPOConfig())


def test_adaptive_entropy_applies_the_coefficient_once_below_the_target_and_moves_it():
    feature = built("adaptive_entropy", use_adaptive_entropy=True, entropy_coef=0.25,
                    entropy_target=0.5, entropy_coef_delta=0.25, entropy_coef_min=0.0,
                    entropy_coef_max=0.6)
    assert feature.coef_now() == 0.0   # before any step the entropy is unknown (inf)
    assert feature.after_step(0.4) == 0.5   # at or below the target: up by delta
    assert feature.coef_now() == 0.5
    assert feature.after_step(0.5) == 0.6   # capped at the maximum
    assert feature.after_step(0.7) == pytest.approx(0.35)   # above: down by delta
    assert feature.coef_now() == 0.0   # the last step was above the target
    assert feature.after_step(2.0) == pytest.approx(0.1)
    assert feature.after_step(2.0) == 0.0   # floored at the minimum
    floored = built("adaptive_entropy", use_adaptive_entropy=True, entropy_coef=0.25,
                    entropy_coef_delta=0.25, entropy_coef_min=0.125, entropy_target=0.5)
    assert floored.after_step(0.7) == 0.125


def test_adaptive_entropy_state_round_trips():
    feature = built("adaptive_entropy", use_adaptive_entropy=True, entropy_coef=0.125,
                    entropy_coef_delta=0.25, entropy_target=0.2)
    assert feature.state_dict() == {"coef": 0.125, "last_entropy": math.inf}
    feature.after_step(0.0625)
    again = built("adaptive_entropy", use_adaptive_entropy=True)
    again.load_state_dict(feature.state_dict())
    assert again.state_dict() == feature.state_dict() == {"coef": 0.375, "last_entropy": 0.0625}
    assert again.coef_now() == feature.coef_now() != 0.0


def test_auto_pruning_keeps_the_first_rounds_rate_then_balances_and_agrees():
    cfg = dict(pruning_rate="auto", async_rollout=True, pruning_rate_start=0.75,
               pruning_rate_min=0.5, pruning_rate_max=0.9)
    feature = built("auto_pruning", **cfg)
    assert feature.state_dict() == {"rate": None}
    waited = {"perf/rollout_wait_s": 1.0, "rollout/generator_idle_s": 0.0, "rollout/duration_s": 2.0}
    assert feature.rate_for_round(waited, rounds_taken=1) == 0.75   # start-up: kept
    lower = feature.rate_for_round(waited, rounds_taken=2)   # the trainer waited: prune less
    assert 0.5 <= lower < 0.75 and feature.rate == lower
    idle = {"perf/rollout_wait_s": 0.0, "rollout/generator_idle_s": 1.0, "rollout/duration_s": 2.0}
    assert feature.rate_for_round(idle, rounds_taken=3) > lower   # the generator idled: more
    assert feature.rate_for_round(idle, rounds_taken=4, agree=lambda rate: 0.6) == 0.6
    capped = built("auto_pruning", **{**cfg, "pruning_rate_start": 0.8, "pruning_rate_max": 0.8})
    assert capped.rate_for_round(idle, rounds_taken=2) == 0.8   # at the upper bound: stays
    floored = built("auto_pruning", **{**cfg, "pruning_rate_start": 0.55, "pruning_rate_min": 0.55})
    assert floored.rate_for_round(waited, rounds_taken=2) == 0.55   # at the lower bound: stays
    again = built("auto_pruning", **cfg)
    again.load_state_dict(feature.state_dict())
    assert again.rate == 0.6


def test_prompt_skipping_updates_streaks_and_draws_with_them():
    feature = built("prompt_skipping", skip_zero_variance_prompts=True,
                    skip_exploration_floor=0.01)
    assert feature.floor == 0.01
    rewards = torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]])   # questions 4 and 9: zero variance
    feature.after_scores([4, 7, 9], rewards)
    assert feature.state_dict() == {"streaks": {"4": 1, "9": 1}}
    feature.after_scores([4, 9], torch.tensor([[1.0, 1.0], [0.0, 1.0]]))
    assert feature.streaks == {"4": 2}
    order, skipped = feature.draw(QuestionStream(10, seed=0), 9, torch.Generator().manual_seed(0))
    assert len(order) == 9 and skipped >= 0
    plain, _ = PromptSkipping(0.01).draw(QuestionStream(10, seed=0), 9,
                                         torch.Generator().manual_seed(0))
    again = PromptSkipping(0.01)
    again.load_state_dict(feature.state_dict())
    assert again.streaks == {"4": 2}
    assert again.draw(QuestionStream(10, seed=0), 9, torch.Generator().manual_seed(0)) == \
        (order, skipped)
    assert 4 not in order or plain != order or skipped == 0   # the streak is used in the draw


def test_fp16_scaling_refuses_half_weights_and_round_trips_its_scale():
    weight = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
    with pytest.raises(ConfigError, match="'fp16' is true but the trainable weights are torch.float16"):
        FP16Scaling.for_weights(torch.device("cpu"), torch.optim.SGD([weight], lr=0.1))
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    feature = FP16Scaling.for_weights(torch.device("cpu"), optimizer)
    feature.scaler.scale(torch.tensor(1.0))   # the scale exists once used
    feature.scaler.update(new_scale=1024.0)
    again = FP16Scaling(torch.device("cpu"))
    again.load_state_dict(feature.state_dict())
    assert again.state_dict()["scale"] == 1024.0


def test_features_save_and_load_by_name():
    a = built("adaptive_entropy", use_adaptive_entropy=True)
    s = PromptSkipping(0.1)
    s.streaks = {"3": 2}
    features = Features([a, s])
    states = features.state_dict()
    assert set(states) == {"adaptive_entropy", "prompt_skipping"}
    fresh = Features([built("adaptive_entropy", use_adaptive_entropy=True), PromptSkipping(0.1)])
    fresh.load_state_dict({**states, "auto_pruning": {"rate": 0.5}})   # one this run lacks: ignored
    assert fresh.state_dict() == states
    fresh.load_state_dict({})   # nothing saved for them: they keep theirs
    assert fresh.state_dict() == states


def test_an_old_checkpoints_flat_keys_become_the_features_states():
    old = {"step": 4, "entropy_coef": 0.3, "last_world_entropy": 0.7, "pruning_rate": 0.8,
           "prompt_streaks": {"5": 1}, "fp16_scaler": {"scale": 512.0}}
    assert states_of_old_checkpoint(old) == {
        "adaptive_entropy": {"coef": 0.3, "last_entropy": 0.7},
        "auto_pruning": {"rate": 0.8}, "prompt_skipping": {"streaks": {"5": 1}},
        "fp16_scaling": {"scale": 512.0}}
    assert states_of_old_checkpoint({"step": 4, "entropy_coef": None, "pruning_rate": None,
                                     "prompt_streaks": {}, "fp16_scaler": None}) == {}


def test_a_checkpoint_written_before_features_were_saved_by_name_resumes(tiny_model_dir, tmp_path):
    """A trainer_state.json in the earlier format (the features' states as flat keys) resumes
    with those states: adaptive entropy's coefficient and last entropy, the prompt streaks."""
    import json

    from helpers import make_trainer
    kw = dict(max_steps=2, save_steps=2, use_adaptive_entropy=True, entropy_coef_delta=0.25,
              entropy_target=100.0, skip_zero_variance_prompts=True)
    first = make_trainer(tiny_model_dir, tmp_path, **kw)
    first.train()
    path = tmp_path / "checkpoint-2" / "trainer_state.json"
    state = json.loads(path.read_text())
    features = state.pop("features")
    assert set(features) == {"adaptive_entropy", "prompt_skipping"}
    old = {**state, "entropy_coef": 0.375, "last_world_entropy": 1.5,   # as written before
           "prompt_streaks": {"7": 3}, "pruning_rate": None, "fp16_scaler": None}
    path.write_text(json.dumps(old))
    again = make_trainer(tiny_model_dir, tmp_path, resume=True, **{**kw, "max_steps": 3})
    assert again._maybe_resume(None) == str(tmp_path / "checkpoint-2")
    assert again.features.get("adaptive_entropy").state_dict() == {"coef": 0.375,
                                                                   "last_entropy": 1.5}
    assert again.features.get("prompt_skipping").streaks == {"7": 3}
    assert again.run_state.step == 2
