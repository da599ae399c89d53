"""One configuration dataclass: TRL GRPOConfig names plus the CPPO fields.

Defaults are the embedded recipe (`cppo train` with no arguments): CPPO with G = 8, P = 0.75 and
dynamic completion allocation on the shipped tiny model and the embedded arithmetic task.
A config comes from defaults, then a YAML file (`--config run.yaml`), then `--name value`
overrides; every value is checked where it enters and a bad one raises `ConfigError` naming the
key, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from cppo.algorithm import Objective, StepShape, local_scope, plan_step
from cppo.algorithm.micro_batch import LossSettings, entropy_bonus_on
from cppo.config.checks import validate
from cppo.config.reading import build_dataclass, from_trl_names, read_yaml
from cppo.config.sections import (DTYPES, LR_SCHEDULERS, AsyncSection, DataSection,  # noqa: F401
                                  DistributedSection, LossSection, ModelSection,
                                  OptimizationSection, PrecisionSection, PruningSection,
                                  RunSection, SamplerCorrectionSection, SamplingSection,
                                  VLLMSection)

SECTIONS = (ModelSection, PrecisionSection, DataSection, SamplingSection, SamplerCorrectionSection,
            VLLMSection, AsyncSection, LossSection, PruningSection, OptimizationSection,
            DistributedSection, RunSection)


@dataclass
class CPPOConfig(RunSection, DistributedSection, OptimizationSection, PruningSection, LossSection,
                 AsyncSection, VLLMSection, SamplerCorrectionSection, SamplingSection, DataSection,
                 PrecisionSection, ModelSection):
    """Everything a run needs: the SECTIONS together, flat (fields in SECTIONS' order). Names
    follow TRL's GRPOConfig where TRL has the concept."""

    def __post_init__(self) -> None:
        validate(self)

    # convenience ----------------------------------------------------------------------------
    @property
    def updates_per_generation(self) -> int:
        """Optimizer steps on one generation round's batch, before num_iterations repeats it
        (steps_per_generation / gradient_accumulation_steps)."""
        spg = self.steps_per_generation or self.gradient_accumulation_steps
        return max(1, spg // self.gradient_accumulation_steps)

    @property
    def steps_per_round(self) -> int:
        """Optimizer steps per generation round: updates_per_generation x num_iterations."""
        return self.updates_per_generation * self.num_iterations

    def loss_settings(self) -> LossSettings:
        """The objective's values one micro-batch's loss reads (cppo.algorithm.micro_batch)."""
        return LossSettings(
            beta=self.beta, max_completion_length=self.max_completion_length,
            top_entropy_quantile=self.top_entropy_quantile,
            off_policy_mask_threshold=self.off_policy_mask_threshold,
            importance_sampling_mode=self.importance_sampling_mode,
            importance_sampling_clip_min=self.importance_sampling_clip_min,
            importance_sampling_clip_max=self.importance_sampling_clip_max,
            entropy_bonus=entropy_bonus_on(self.entropy_coef, self.use_adaptive_entropy),
            objective=Objective(
                epsilon_low=self.epsilon, epsilon_high=self.effective_epsilon_high,
                loss_type=self.loss_type, importance_sampling_level=self.importance_sampling_level,
                delta=self.delta, use_bias_correction_kl=self.use_bias_correction_kl,
                sapo_temperature_pos=self.sapo_temperature_pos,
                sapo_temperature_neg=self.sapo_temperature_neg,
                vespo=dict(k_pos=self.vespo_k_pos, lambda_pos=self.vespo_lambda_pos,
                           k_neg=self.vespo_k_neg, lambda_neg=self.vespo_lambda_neg)))

    def step_plan(self) -> StepShape:
        """Questions sampled, completions scored and kept per generation round (algorithm/allocation):
        per optimizer step unless steps_per_generation makes a round several steps' slices."""
        return plan_step(completions_per_update=self.completions_per_update *
                         self.updates_per_generation,
                         group_size=self.num_generations, pruning_rate=self.planned_pruning_rate,
                         allocation=self.allocation,
                         scope=local_scope(self.selection_scope))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))

    @classmethod
    def from_dict(cls, values: dict[str, Any], *, source: str = "config") -> "CPPOConfig":
        return build_dataclass(cls, values, source=source)

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: dict[str, Any] | None = None
             ) -> "CPPOConfig":
        """Defaults, then a YAML file, then overrides (strings from the command line are parsed)."""
        values: dict[str, Any] = {}
        if path is not None:
            values.update(read_yaml(path))
        values.update(overrides or {})
        values = from_trl_names(values, cls, source=str(path) if path else "config")
        return cls.from_dict(values, source=str(path) if path else "config")
