"""The optional parts of a run, one object each: adaptive entropy control, pruning_rate auto,
prompt skipping, the two-stage draw and fp16 loss scaling. Each holds its settings (read from the config once), its
state, and the hooks the trainer calls at named points of a round; the state is saved in the
checkpoint under the feature's name (`Features.state_dict`) and read back on resume.

`build_features(loss, pruning, sampling, fp16=...)` returns the ones the config's sections turn
on. A run without a feature has no object for it: the trainer asks `features.get(name)`."""

from __future__ import annotations

from typing import Protocol

from cppo.algorithm.balance import AUTO
from cppo.config.sections import LossSection, PruningSection, SamplingSection
from cppo.features.adaptive_entropy import AdaptiveEntropy, EntropySettings
from cppo.features.auto_pruning import AutoPruning, AutoPruningSettings
from cppo.features.fp16_scaling import FP16Scaling
from cppo.features.prompt_skipping import PromptSkipping
from cppo.features.two_stage import TwoStage

__all__ = ["AdaptiveEntropy", "AutoPruning", "FP16Scaling", "Feature", "Features",
           "PromptSkipping", "TwoStage", "build_features", "states_of_old_checkpoint"]


class Feature(Protocol):
    name: str

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class Features:
    """The features a run has, by name, with their states saved and loaded together."""

    def __init__(self, features: list[Feature]) -> None:
        self.by_name = {f.name: f for f in features}

    def get(self, name: str):
        return self.by_name.get(name)

    def __contains__(self, name: str) -> bool:
        return name in self.by_name

    def state_dict(self) -> dict[str, dict]:
        return {name: f.state_dict() for name, f in self.by_name.items()}

    def load_state_dict(self, states: dict[str, dict]) -> None:
        """Each feature's saved state (a feature the checkpoint has no state for keeps its own;
        states of features this run does not have are ignored)."""
        for name, feature in self.by_name.items():
            if states.get(name) is not None:
                feature.load_state_dict(states[name])


def build_features(loss: LossSection, pruning: PruningSection, sampling: SamplingSection,
                   fp16: FP16Scaling | None = None) -> Features:
    """The features the config's sections turn on, each with its settings read from them:
    adaptive entropy (loss), pruning_rate auto (pruning), prompt skipping and the two-stage draw
    (sampling); fp16: the learner's loss scaling (it owns the scaler)."""
    found: list[Feature] = []
    if loss.use_adaptive_entropy:
        found.append(AdaptiveEntropy(EntropySettings(
            start=loss.entropy_coef, target=loss.entropy_target, delta=loss.entropy_coef_delta,
            low=loss.entropy_coef_min, high=loss.entropy_coef_max)))
    if pruning.pruning_rate == AUTO:
        found.append(AutoPruning(AutoPruningSettings(
            start=pruning.pruning_rate_start, low=pruning.pruning_rate_min,
            high=pruning.pruning_rate_max)))
    if sampling.skip_zero_variance_prompts:
        found.append(PromptSkipping(floor=sampling.skip_exploration_floor))
    if sampling.two_stage_generations:
        found.append(TwoStage(sampling.two_stage_generations, sampling.two_stage_exploration))
    if fp16 is not None:
        found.append(fp16)
    return Features(found)


def states_of_old_checkpoint(values: dict) -> dict[str, dict]:
    """The features' states of a trainer_state.json written before features were saved by
    name (flat keys entropy_coef, last_world_entropy, pruning_rate, prompt_streaks,
    fp16_scaler); only the keys a checkpoint has."""
    states: dict[str, dict] = {}
    if values.get("entropy_coef") is not None:
        states[AdaptiveEntropy.name] = {"coef": values["entropy_coef"],
                                        "last_entropy": values.get("last_world_entropy",
                                                                   float("inf"))}
    if values.get("pruning_rate") is not None:
        states[AutoPruning.name] = {"rate": values["pruning_rate"]}
    if values.get("prompt_streaks"):
        states[PromptSkipping.name] = {"streaks": values["prompt_streaks"]}
    if values.get("fp16_scaler"):
        states[FP16Scaling.name] = values["fp16_scaler"]
    return states
