"""Adaptive entropy control (Skywork-OR1; TRL's use_adaptive_entropy): the entropy bonus's
coefficient moves by entropy_coef_delta after each optimizer step toward keeping the policy's
token entropy at entropy_target, within [entropy_coef_min, entropy_coef_max]; a step applies it
only while the previous step's entropy was at or below the target (cppo.algorithm.loss)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from cppo.algorithm import adapted_entropy_coef, applied_entropy_coef


@dataclass(frozen=True)
class EntropySettings:
    start: float        # entropy_coef: the coefficient before the first step
    target: float       # entropy_target
    delta: float        # entropy_coef_delta
    low: float          # entropy_coef_min
    high: float         # entropy_coef_max


class AdaptiveEntropy:
    name = "adaptive_entropy"

    def __init__(self, settings: EntropySettings) -> None:
        self.settings = settings
        self.coef = settings.start
        self.last_entropy = math.inf   # the last step's mean token entropy (inf: no step yet)

    def coef_now(self) -> float:
        """The coefficient the next step applies (hook: before an optimizer step)."""
        return applied_entropy_coef(self.coef, self.last_entropy, self.settings.target)

    def after_step(self, entropy: float) -> float:
        """The update after a step whose mean token entropy (every process's) was `entropy`
        (hook: after an optimizer step); returns the new coefficient."""
        s = self.settings
        self.coef = adapted_entropy_coef(self.coef, entropy, target=s.target, delta=s.delta,
                                         coef_min=s.low, coef_max=s.high)
        self.last_entropy = entropy
        return self.coef

    def state_dict(self) -> dict:
        return {"coef": self.coef, "last_entropy": self.last_entropy}

    def load_state_dict(self, state: dict) -> None:
        self.coef, self.last_entropy = float(state["coef"]), float(state["last_entropy"])
