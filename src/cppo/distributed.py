"""Data parallelism over torch.distributed (gloo on CPU, nccl on GPU), started by torchrun or
`accelerate launch` (both set RANK / WORLD_SIZE / MASTER_ADDR). One process: every call is a no-op.

Each process generates and scores its own questions (whole groups, so group statistics are
local); counts for the loss normaliser are summed over processes, gradients are averaged, and
`selection_scope=global` ranks the completions of all processes together.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Distributed:
    rank: int = 0
    world_size: int = 1

    @classmethod
    def from_environment(cls) -> "Distributed":
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls()
        if not dist.is_initialized():
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend=backend)
        return cls(rank=dist.get_rank(), world_size=dist.get_world_size())

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1

    def sum(self, value: int | float) -> int | float:
        if not self.active:
            return value
        t = torch.tensor([float(value)], dtype=torch.float64)
        dist.all_reduce(t)
        return type(value)(t.item())

    def all_zero(self, advantages: torch.Tensor) -> bool:
        """True when every process's kept advantages are all zero (all must agree to skip)."""
        local = float(advantages.numel() > 0 and bool((advantages != 0).any()))
        return self.sum(local) == 0

    def average_gradients(self, model) -> None:
        if not self.active:
            return
        for p in model.parameters():
            if p.requires_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad)
                p.grad /= self.world_size

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate equal-shaped tensors of all processes along dim 0 (rank order)."""
        if not self.active:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts)

    def select_global(self, advantages, rewards, num_keep_per_process: int, rule: str, generator):
        """keep_mask (Q, G) of this process from a selection over all processes' completions."""
        from cppo.algorithm import select_completions
        all_adv, all_rew = self.gather(advantages), self.gather(rewards)
        keep = select_completions(all_adv, all_rew, num_keep=num_keep_per_process * self.world_size,
                                  scope="step", rule=rule, generator=generator)
        q = advantages.shape[0]
        return keep[self.rank * q:(self.rank + 1) * q]
