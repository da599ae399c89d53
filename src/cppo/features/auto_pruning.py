"""pruning_rate auto: each round's pruning rate moves within [pruning_rate_min,
pruning_rate_max] from pruning_rate_start, by how long the trainer waited for the round and the
generator waited for its task (cppo.algorithm.balance), so that neither side idles."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from cppo.algorithm.balance import balanced_pruning_rate


@dataclass(frozen=True)
class AutoPruningSettings:
    start: float   # pruning_rate_start
    low: float     # pruning_rate_min
    high: float    # pruning_rate_max


class AutoPruning:
    name = "auto_pruning"

    def __init__(self, settings: AutoPruningSettings) -> None:
        self.settings = settings
        self.rate: float | None = None   # the last round's rate (None: no round yet)

    def rate_for_round(self, rollout: dict, rounds_taken: int,
                       agree: Callable[[float], float] = lambda rate: rate) -> float:
        """This round's rate (hook: after a round arrives, before selection), moved from the
        last round's by its `rollout` metrics (the trainer's wait, the generator's idle time,
        the round's duration). A session's first round keeps it: the generator's start-up is in
        that wait. `agree`: the processes' common value (the first process's, broadcast)."""
        s = self.settings
        rate = s.start if self.rate is None else self.rate
        if rounds_taken > 1:
            rate = balanced_pruning_rate(
                rate, trainer_wait=rollout["perf/rollout_wait_s"],
                generator_idle=rollout["rollout/generator_idle_s"],
                round_seconds=rollout["rollout/duration_s"], low=s.low, high=s.high)
        self.rate = agree(rate)
        return self.rate

    def state_dict(self) -> dict:
        return {"rate": self.rate}

    def load_state_dict(self, state: dict) -> None:
        self.rate = state["rate"]
