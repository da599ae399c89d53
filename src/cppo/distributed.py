"""Data parallelism over torch.distributed (gloo on CPU, nccl on GPU), started by torchrun or
`accelerate launch` (both set RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR). One process: every
call is a no-op.

The step is cut along questions: all processes walk the same seeded question order and each takes
its own contiguous slice of the global step batch, so N processes x Q/N questions see the same
questions as 1 process x Q. Each process generates and scores its own questions (whole groups, so
per-question statistics are local); `scale_rewards=batch` uses the std over all processes; counts
for the loss normaliser are summed over processes, gradients are averaged, and
`selection_scope=global` ranks the completions of all processes together.

Only plain data parallelism (each process holds the whole model: DDP-style). FSDP and DeepSpeed
shard parameters, which the manual gradient all-reduce here cannot handle; `check_launcher`
refuses them with an explanation (docs/distributed.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


class UnsupportedLauncherError(RuntimeError):
    """An accelerate launch mode (FSDP, DeepSpeed) that this trainer does not support."""


def check_launcher(environ=os.environ) -> None:
    """Raise UnsupportedLauncherError under `accelerate launch` with FSDP or DeepSpeed."""
    for variable, name in (("ACCELERATE_USE_FSDP", "FSDP"), ("ACCELERATE_USE_DEEPSPEED", "DeepSpeed")):
        if environ.get(variable, "").lower() in ("1", "true", "yes"):
            raise UnsupportedLauncherError(
                f"accelerate launch with {name} ({variable}=true) is not supported: cppo's trainer "
                f"does plain data parallelism (every process holds the whole model, gradients are "
                f"all-reduced by hand), which cannot work on sharded parameters. Use "
                f"examples/accelerate/ddp.yaml (or torchrun); for models that do not fit one GPU, "
                f"use LoRA (use_peft: true) with gradient_checkpointing. See docs/distributed.md.")


@dataclass
class Distributed:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @classmethod
    def from_environment(cls) -> "Distributed":
        check_launcher()
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls(device=device)
        if not dist.is_initialized():
            dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
        return cls(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank,
                   device=device)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1

    @property
    def comm_device(self) -> torch.device:
        """Where collective tensors live: nccl needs CUDA tensors, gloo takes CPU ones."""
        return self.device if dist.is_initialized() and dist.get_backend() == "nccl" else torch.device("cpu")

    def sum(self, value: int | float) -> int | float:
        if not self.active:
            return value
        t = torch.tensor([float(value)], dtype=torch.float64, device=self.comm_device)
        dist.all_reduce(t)
        return type(value)(t.item())

    def any(self, flag: bool) -> bool:
        """True on every process when the flag is true on at least one."""
        return bool(self.sum(int(bool(flag))) > 0)

    def all_zero(self, advantages: torch.Tensor) -> bool:
        """True when every process's kept advantages are all zero (all must agree to skip)."""
        local = float(advantages.numel() > 0 and bool((advantages != 0).any()))
        return self.sum(local) == 0

    def broadcast_parameters(self, model) -> None:
        """Make every process start from rank 0's parameters (e.g. randomly initialised LoRA)."""
        if not self.active:
            return
        for p in model.parameters():
            t = p.data.to(self.comm_device)
            dist.broadcast(t, src=0)
            if t is not p.data:
                p.data.copy_(t)

    def average_gradients(self, model, bucket_elements: int = 2**25) -> None:
        """All-reduce the mean gradient, in flat buckets (one collective per ~32M values)."""
        if not self.active:
            return
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        bucket, size = [], 0
        for p in params + [None]:
            if p is not None and (not bucket or (p.grad.dtype == bucket[0].grad.dtype
                                                 and size + p.numel() <= bucket_elements)):
                bucket.append(p)
                size += p.numel()
                continue
            if bucket:
                flat = torch.cat([q.grad.reshape(-1) for q in bucket]).to(self.comm_device)
                dist.all_reduce(flat)
                flat /= self.world_size
                offset = 0
                for q in bucket:
                    q.grad.copy_(flat[offset:offset + q.numel()].view_as(q.grad))
                    offset += q.numel()
            bucket, size = ([p], p.numel()) if p is not None else ([], 0)

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate equal-shaped tensors of all processes along dim 0 (rank order)."""
        if not self.active:
            return tensor
        local = tensor.contiguous().to(self.comm_device)
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local)
        return torch.cat(parts).to(tensor.device)

    def gather_objects(self, obj) -> list:
        if not self.active:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def group_advantages(self, rewards: torch.Tensor, scale_rewards: str) -> torch.Tensor:
        """GRPO advantages (Q, G); with scale_rewards=batch the std is over every process's rewards."""
        from cppo.algorithm import group_advantages
        if scale_rewards != "batch" or not self.active:
            return group_advantages(rewards, scale_rewards)
        centered = group_advantages(rewards, "none")
        everything = self.gather(rewards)
        if everything.shape[1] < 2:
            return torch.zeros_like(rewards)
        return centered / (everything.std() + 1e-4)

    def select_global(self, advantages, rewards, num_keep_per_process: int, rule: str, generator):
        """keep_mask (Q, G) of this process from a selection over all processes' completions."""
        from cppo.algorithm import select_completions
        all_adv, all_rew = self.gather(advantages), self.gather(rewards)
        keep = select_completions(all_adv, all_rew, num_keep=num_keep_per_process * self.world_size,
                                  scope="step", rule=rule, generator=generator)
        q = advantages.shape[0]
        return keep[self.rank * q:(self.rank + 1) * q]
