"""The training questions a step draws: a seeded, resumable stream over the data's rows, and
skip_zero_variance_prompts' passing over of questions predicted to teach nothing
(cppo.algorithm.skipping)."""

from __future__ import annotations

import torch

from cppo.algorithm.skipping import keep_probability, updated_streaks, zero_variance_groups

SKIP_DRAW_LIMIT = 8   # skip_zero_variance_prompts: draws per question a step needs, at most


class QuestionStream:
    """Training questions in a seeded random order, epoch after epoch; its state is resumable."""

    def __init__(self, num_rows: int, seed: int) -> None:
        self.num_rows, self.seed = num_rows, seed
        self.epoch, self.position = 0, 0
        self._order = self._permutation()

    def _permutation(self) -> list[int]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.num_rows, generator=gen).tolist()

    def take(self, n: int) -> list[int]:
        out = []
        while len(out) < n:
            if self.position == self.num_rows:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation()
            grab = min(n - len(out), self.num_rows - self.position)
            out += self._order[self.position:self.position + grab]
            self.position += grab
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._permutation()


def draw_skipping(stream: QuestionStream, want: int, streaks: dict[str, int], floor: float,
                  generator: torch.Generator, draw_limit: int = SKIP_DRAW_LIMIT
                  ) -> tuple[list[int], int]:
    """`want` question indices from the stream, each drawn question kept with probability
    keep_probability(its streak) (the same draws on every process: the generator is seeded by
    the round); after draw_limit x want draws the rest are taken as they come. Returns them and
    how many were passed over."""
    order, skipped, drawn = [], 0, 0
    while len(order) < want:
        batch = stream.take(want - len(order))
        drawn += len(batch)
        counts = torch.tensor([streaks.get(str(i), 0) for i in batch])
        keep = torch.rand(len(batch), generator=generator, dtype=torch.float64) < \
            keep_probability(counts, floor)
        if drawn > draw_limit * want:
            keep[:] = True
        order += [i for i, k in zip(batch, keep.tolist()) if k]
        skipped += int((~keep).sum())
    return order, skipped


def next_streaks(streaks: dict[str, int], order: list[int], rewards: torch.Tensor) -> dict[str, int]:
    """The zero-variance streaks after a step that drew questions `order` (all processes') and
    scored them `rewards` (Q, G) (all processes'): a new dict, 0 streaks left out."""
    keys = [str(i) for i in order]
    old = torch.tensor([streaks.get(k, 0) for k in keys])
    out = dict(streaks)
    for key, streak in zip(keys, updated_streaks(old, zero_variance_groups(rewards).cpu()).tolist()):
        if streak:
            out[key] = streak
        else:
            out.pop(key, None)
    return out
