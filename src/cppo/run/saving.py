"""Saving a run and resuming it: every rank's RNG with the checkpoint (cppo.run.checkpoint
writes and reads the files), and the newest complete checkpoint found and loaded back."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from cppo.run import checkpoint as ckpt


def rng_state(device: torch.device) -> dict:
    """This process's RNG states: torch's, and the CUDA device's when it trains on one."""
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


@dataclass
class Checkpointer:
    """Where and what a run saves (cppo.run.checkpoint writes and reads the files): the model
    or its LoRA adapters, the optimizer and schedule, every rank's RNG and the run state, at
    most `keep` checkpoints in output_dir (None: all). engine: ddp / fsdp / one process (fsdp
    saves shards); dist: the processes (cppo.parallel.processes.Distributed)."""

    output_dir: Path
    model: torch.nn.Module
    tokenizer: object
    optimizer: torch.optim.Optimizer
    scheduler: object
    engine: object
    dist: object
    keep: int | None = None

    def save(self, step: int, trainer_state: dict, final: bool = False) -> Path | None:
        """Every process takes part. Rank 0 writes the checkpoint; under fsdp all processes
        write their shards, and the final one also holds the consolidated model (a Hugging Face
        folder)."""
        dist, engine = self.dist, self.engine
        per_rank = dist.gather_objects(rng_state(dist.device))
        rng = {**per_rank[0], **{f"rank{r}/{k}": v for r, states in enumerate(per_rank)
                                 for k, v in states.items()}}
        sharded = engine.sharded
        contents = ckpt.CheckpointContents(
            self.model, self.tokenizer, self.optimizer, self.scheduler, rng, trainer_state,
            sharded_state=engine.sharded_state(self.optimizer) if sharded else None,
            consolidated=engine.full_model_state() if sharded and final else None)
        return ckpt.save_checkpoint(self.output_dir, step, contents, keep=self.keep, dist=dist)

    def to_resume(self, *, resume: bool, restarts: int) -> Path | None:
        """--resume, or a restart by the launcher (`restarts`, torchrun --max-restarts): the
        newest complete checkpoint in output_dir (rank 0 looks and clears leftovers of killed
        writes; every process gets the same one); None: start from scratch."""
        if not (resume or restarts):
            return None
        if restarts and not resume:
            print(f"restart {restarts} by the launcher: resuming from the newest checkpoint in "
                  f"{self.output_dir}")
        dist = self.dist
        latest = dist.broadcast_object(ckpt.latest_checkpoint(self.output_dir) if dist.is_main
                                       else None)
        if latest is None:
            print(f"--resume: no checkpoint in {self.output_dir}; starting from scratch")
        return latest

    def load(self, latest: Path) -> ckpt.RunState:
        """Load checkpoint `latest` into the model, optimizer, schedule and this rank's RNG;
        returns its run state (the question stream's and the features' states are in it)."""
        engine, device = self.engine, self.dist.device
        engine.check_resume(ckpt.load_trainer_state(latest, missing_ok=True), latest)
        if engine.sharded:
            engine.load_sharded_state(latest, self.optimizer)
        else:
            ckpt.load_model_weights(self.model, latest)
            self.optimizer.load_state_dict(ckpt.load_tensors(latest / "optimizer.pt"))
        self.scheduler.load_state_dict(ckpt.load_tensors(latest / "scheduler.pt"))
        rng = ckpt.load_tensors(latest / "rng_state.pt")
        mine = f"rank{self.dist.rank}/"    # this rank's states if it was saved with as many ranks
        rng = {k[len(mine):]: v for k, v in rng.items() if k.startswith(mine)} or rng
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], device)
        return ckpt.RunState.from_dict(ckpt.load_trainer_state(latest))


def save_pretrained_folder(policy, tokenizer, target: Path, dist) -> Path | None:
    """The policy and its tokenizer as a Hugging Face folder (LoRA: the adapters in PEFT's
    format), written by the main process; every process waits for it. The folder on the main
    process, None elsewhere."""
    if dist.is_main:
        target.mkdir(parents=True, exist_ok=True)
        policy.save_pretrained(target, safe_serialization=True)
        tokenizer.save_pretrained(target)
    dist.barrier()
    return target if dist.is_main else None
