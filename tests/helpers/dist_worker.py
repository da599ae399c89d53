"""One CPPO run for tests/test_distributed.py: under torchrun (N processes) or in-process (1).

    python -m torch.distributed.run --nproc_per_node 2 tests/helpers/dist_worker.py spec.json

spec.json: {"config": {...CPPOConfig fields...}, "rows": [...], "model": dir}. Each process writes
to <output_dir>: questions-rank<r>.json (the questions it drew), summary-rank<r>.json (train()'s
summary), bytes-rank<r>.json (the parameter, gradient and optimizer bytes it holds at the end)
pid-rank<r> (its process id, written before training) and reductions-rank<r>.json (how many
gradient reductions the engine ran, and how many optimizer steps), lean-rank<r>.json (why the
lean forward cannot run on the model, None when it can: inside and outside `Engine.gathered`);
rank 0 also writes
logits.pt, the trained model's logits on a fixed input (through the sharded model under fsdp).
"""

import json
import os
import sys

import torch


def length_reward(prompts, completions, completion_ids=None, **kw):
    return [float(len(c) % 2) + 0.1 * (len(c) % 3) for c in completions]


def count_reductions(trainer) -> dict:
    """Count the engine's gradient collectives: DDP's bucket all-reduces (a comm hook that
    counts, then all-reduces as DDP's default does) or FSDP2's reduce-scatters."""
    import torch.distributed as dist
    counts = {"reductions": 0}
    if trainer.engine.ddp is not None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        def hook(state, bucket):
            counts["reductions"] += 1
            return default_hooks.allreduce_hook(None, bucket)
        trainer.engine.ddp.register_comm_hook(None, hook)
    elif trainer.engine.sharded:
        original = dist.reduce_scatter_single

        def counted(*args, **kwargs):
            counts["reductions"] += 1
            return original(*args, **kwargs)
        dist.reduce_scatter_single = counted
    return counts


def run(spec: dict) -> dict:
    from cppo.config import CPPOConfig
    from cppo.parallel import local_bytes
    from cppo.trainer import CPPOTrainer
    out = spec["config"]["output_dir"]
    trainer = CPPOTrainer(model=spec["model"], reward_funcs=[length_reward],
                          args=CPPOConfig(**spec["config"]), train_dataset=spec["rows"])
    rank = trainer.dist.rank
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"pid-rank{rank}"), "w") as fh:
        fh.write(str(os.getpid()))
    reductions = count_reductions(trainer)
    drawn = []
    take = trainer.take_questions

    def record():
        rows = take()
        drawn.append([r["prompt"] for r in rows])
        return rows
    trainer.take_questions = record
    summary = trainer.train()
    reductions["optimizer_steps"] = summary["steps"] - summary["skipped_steps"]
    for name, value in (("questions", drawn), ("summary", summary), ("reductions", reductions),
                        ("bytes", local_bytes(trainer.policy, trainer.optimizer))):
        with open(os.path.join(out, f"{name}-rank{rank}.json"), "w") as fh:
            json.dump(value, fh)
    from cppo.models.lean import lean_forward_for
    with trainer.engine.gathered():   # what generation runs on: the lean forward if it can
        lean = {"gathered": lean_forward_for(trainer.policy)[1],
                "gathered_dtype": str(trainer.policy.get_input_embeddings().weight.dtype)}
    lean["outside"] = lean_forward_for(trainer.policy)[1]
    with open(os.path.join(out, f"lean-rank{rank}.json"), "w") as fh:
        json.dump(lean, fh)
    with torch.no_grad():   # every process joins (the sharded forward gathers each block)
        ids = torch.arange(3, 15).view(2, 6) % trainer.policy.config.vocab_size
        logits = trainer.policy(input_ids=ids).logits.float()
    if rank == 0:
        torch.save({"input_ids": ids, "logits": logits}, os.path.join(out, "logits.pt"))
    return summary


if __name__ == "__main__":
    torch.set_num_threads(1)
    with open(sys.argv[1]) as fh:
        run(json.load(fh))
