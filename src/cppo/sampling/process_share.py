"""The asynchronous generator as each training process sees it (torchrun: N training processes,
one generator, held by the first process): ProcessShare submits the rounds, pushes the weights
and scatters each sampled round's parts, so every process receives its own."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed

from cppo.errors import GeneratorError
from cppo.sampling.rollout_messages import Arrival, Failure, RolloutTask


class ProcessShare:
    """The generator as each training process sees it. Under torchrun the first process holds it
    (`generator`; None on the others): it submits the rounds (every process's rows), pushes the
    weights and scatters each sampled round's parts, and each process receives its own on its
    device. A generator error on the first process reaches every process as the same
    GeneratorError. One process: the round's only part. gathered: the engine's context that
    holds the full weights (fsdp), entered by every process around a push."""

    def __init__(self, generator, dist, device, gathered=contextlib.nullcontext) -> None:
        self.generator, self.dist, self.device, self.gathered = generator, dist, device, gathered
        self.name = generator.name if generator is not None else "generator of the first process"

    def submit(self, task: RolloutTask) -> None:
        if self.generator is not None:
            self.generator.submit(task)

    def receive(self) -> Arrival:
        if not self.dist.active:
            return self.generator.receive().part(0)
        parts = None
        if self.generator is not None:
            try:
                got = self.generator.receive()
            except GeneratorError as error:
                self._scatter([Failure(str(error))] * self.dist.world_size)
                raise
            parts = [got.part(rank).to("cpu") for rank in range(self.dist.world_size)]
        mine = self._scatter(parts)
        if isinstance(mine, Failure):
            raise GeneratorError(f"on the first process: {mine.text}")
        return mine.to(self.device)

    def _scatter(self, parts: list | None):
        box = [None]
        torch.distributed.scatter_object_list(box, parts, src=0)
        return box[0]

    def push(self, policy, version: int) -> float:
        """Every process enters (fsdp gathers); the first one pushes. Its seconds (0 elsewhere)."""
        with self.gathered():
            return 0.0 if self.generator is None else self.generator.push(policy, version)

    def close(self) -> None:
        if self.generator is not None:
            self.generator.close()
