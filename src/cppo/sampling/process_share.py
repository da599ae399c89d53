"""The asynchronous generator as each training process sees it (torchrun: N training processes,
one generator, held by the first process): ProcessShare submits the rounds, pushes the weights
and scatters each sampled round's parts, so every process receives its own."""

from __future__ import annotations

import torch
import torch.distributed

from cppo.errors import GeneratorError
from cppo.sampling.rollout_messages import Arrival, Failure, RolloutTask
from cppo.sampling.weight_sinks import drain, full_parameters, trainable_names


class ProcessShare:
    """The generator as each training process sees it. Under torchrun the first process holds it
    (`generator`; None on the others): it submits the rounds (every process's rows), pushes the
    weights and scatters each sampled round's parts, and each process receives its own on its
    device. A generator error on the first process reaches every process as the same
    GeneratorError. One process: the round's only part. sharded: the policy is sharded (fsdp),
    so a push is a collective: every process takes part in each parameter's gather, in turn,
    and only the first one's sink keeps them (cppo.sampling.weight_sinks.full_parameters), in
    the order of `pushed` (the parameter names the first one's sink gathers, every process the
    same: the trainable ones for cppo's generator process, None; all of them for a vLLM
    server, which reloads whole weights)."""

    def __init__(self, generator, dist, device, sharded: bool = False,
                 pushed: list[str] | None = None) -> None:
        self.generator, self.dist, self.device, self.sharded = generator, dist, device, sharded
        self.pushed = pushed
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
        """The first process pushes (its seconds; 0 elsewhere); under fsdp the others take part
        in the gather of each trainable parameter as its sink copies them."""
        if self.generator is not None:
            return self.generator.push(policy, version)
        if self.sharded:
            drain(full_parameters(policy, self.pushed or trainable_names(policy)))
        return 0.0

    @property
    def pushed_bytes(self) -> int:
        """The bytes of the first process's last push (its sink's; 0 elsewhere)."""
        return self.generator.pushed_bytes if self.generator is not None else 0

    def join_staging(self, policy) -> None:
        """(fsdp, the processes without the generator.) Take part in the gathers that fill the
        first process's staging copy of every parameter when its generator is made."""
        if self.generator is None and self.sharded:
            drain(full_parameters(policy, [name for name, _ in policy.named_parameters()]))

    def close(self) -> None:
        if self.generator is not None:
            self.generator.close()
