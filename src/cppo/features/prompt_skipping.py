"""skip_zero_variance_prompts: questions whose completions all got the same reward in a row
(a zero-variance streak) are drawn less often, down to skip_exploration_floor
(cppo.data.questions); the streaks are this feature's state."""

from __future__ import annotations

import torch

from cppo.data.questions import QuestionStream, draw_skipping, next_streaks


class PromptSkipping:
    name = "prompt_skipping"

    def __init__(self, floor: float) -> None:
        self.floor = floor   # skip_exploration_floor: the lowest chance a question is kept
        self.streaks: dict[str, int] = {}   # question index (str) -> its streak, where > 0

    def draw(self, stream: QuestionStream, want: int,
             generator: torch.Generator) -> tuple[list[int], int]:
        """`want` question indices and how many were passed over (hook: taking a round's
        questions; the generator is seeded by the round, the same on every process)."""
        return draw_skipping(stream, want, self.streaks, self.floor, generator)

    def after_scores(self, order: list[int], rewards: torch.Tensor) -> None:
        """The streaks after a round that drew `order` and scored it `rewards` (Q, G), both
        every process's (hook: after scoring)."""
        self.streaks = next_streaks(self.streaks, order, rewards)

    def state_dict(self) -> dict:
        return {"streaks": dict(self.streaks)}

    def load_state_dict(self, state: dict) -> None:
        self.streaks = dict(state["streaks"])
