"""Saving a run and resuming it: every rank's RNG with the checkpoint (cppo.run.checkpoint
writes and reads the files), and the newest complete checkpoint found and loaded back."""

from __future__ import annotations

from pathlib import Path

import torch

from cppo.run import checkpoint as ckpt


def rng_state(device: torch.device) -> dict:
    """This process's RNG states: torch's, and the CUDA device's when it trains on one."""
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def save_run(output_dir: Path, step: int, trainer_state: dict, *, model, tokenizer, optimizer,
             scheduler, engine, dist, device: torch.device, keep: int | None,
             final: bool) -> Path | None:
    """Every process takes part. Rank 0 writes the checkpoint (model or LoRA adapters,
    optimizer, every rank's RNG, the run state); under fsdp all processes write their shards, and
    the final one also holds the consolidated model (a Hugging Face folder)."""
    per_rank = dist.gather_objects(rng_state(device))
    rng = {**per_rank[0], **{f"rank{r}/{k}": v for r, states in enumerate(per_rank)
                             for k, v in states.items()}}
    sharded = engine.sharded
    return ckpt.save_checkpoint(
        output_dir, step, model=model, tokenizer=tokenizer, optimizer=optimizer,
        scheduler=scheduler, rng_states=rng, trainer_state=trainer_state, keep=keep, dist=dist,
        sharded_state=engine.sharded_state(optimizer) if sharded else None,
        consolidated=engine.full_model_state() if sharded and final else None)


def checkpoint_to_resume(output_dir: Path, dist, *, resume: bool, restarts: int) -> Path | None:
    """--resume, or a restart by the launcher (`restarts`, torchrun --max-restarts): the newest
    complete checkpoint in output_dir (rank 0 looks and clears leftovers of killed writes; every
    process gets the same one); None: start from scratch."""
    if not (resume or restarts):
        return None
    if restarts and not resume:
        print(f"restart {restarts} by the launcher: resuming from the newest checkpoint in "
              f"{output_dir}")
    latest = dist.broadcast_object(ckpt.latest_checkpoint(output_dir) if dist.is_main else None)
    if latest is None:
        print(f"--resume: no checkpoint in {output_dir}; starting from scratch")
    return latest


def load_run(latest: Path, *, model, optimizer, scheduler, engine, rank: int,
             device: torch.device) -> ckpt.RunState:
    """Load a checkpoint into the model, optimizer, schedule and this rank's RNG; returns its
    run state."""
    engine.check_resume(ckpt.load_trainer_state(latest, missing_ok=True), latest)
    if engine.sharded:
        engine.load_sharded_state(latest, optimizer)
    else:
        ckpt.load_model_weights(model, latest)
        optimizer.load_state_dict(ckpt.load_tensors(latest / "optimizer.pt"))
    scheduler.load_state_dict(ckpt.load_tensors(latest / "scheduler.pt"))
    rng = ckpt.load_tensors(latest / "rng_state.pt")
    mine = f"rank{rank}/"    # this rank's states if it was saved with as many ranks
    rng = {k[len(mine):]: v for k, v in rng.items() if k.startswith(mine)} or rng
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"], device)
    return ckpt.RunState.from_dict(ckpt.load_trainer_state(latest))


def resume_run(trainer, latest: Path, log):
    """Load checkpoint `latest` into the trainer's model, optimizer, schedule, RNG and question
    stream; cut the metrics log and the completions table back to its step. Returns its run state
    (the features' states, in its `features`, are the trainer's to load)."""
    state = load_run(latest, model=trainer.policy, optimizer=trainer.optimizer,
                     scheduler=trainer.scheduler, engine=trainer.engine, rank=trainer.dist.rank,
                     device=trainer.device)
    trainer.questions.load_state(state.questions)
    if log is not None:
        log.truncate_after(state.step)
    if trainer.completions_log is not None:
        trainer.completions_log.truncate_after(state.step)
    print(f"resumed from {latest} at step {state.step}")
    return state


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
