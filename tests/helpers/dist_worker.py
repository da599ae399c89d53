"""One CPPO run for tests/test_distributed.py: under torchrun (N processes) or in-process (1).

    python -m torch.distributed.run --nproc_per_node 2 tests/helpers/dist_worker.py spec.json

spec.json: {"config": {...CPPOConfig fields...}, "rows": [...], "model": dir, "post_run": bool
(default true: the collectives after train() below), "raise_at_step": [rank, step] (that rank
raises a RuntimeError in the round that starts at that step), "park_at_step": [rank, step] (that
rank's first reward call at that step writes parked-rank<r> and waits, up to 300 s, for a stop
signal or stop-rank<r>; only on a launcher's first start), "plain_init": bool (benchmarks/
restarts.py's "before" rows: the group started by a plain init_process_group under the launcher's
shared keys, as before cppo.parallel.processes.start_group)}. Each process writes to <output_dir>:
questions-rank<r>.json (the questions it drew), rewarded-rank<r>.json (each reward call's prompt
and completion texts), summary-rank<r>.json (train()'s summary),
bytes-rank<r>.json (the parameter, gradient and optimizer bytes it holds at the end), pid-rank<r>
(its process id, written before training), reductions-rank<r>.json (how many gradient reductions
the engine ran, and how many optimizer steps), roles-rank<r>.json (its global and local rank and
the callbacks' is_world/local_process_zero), lean-rank<r>.json (why the lean forward cannot run on
the model, None when it can: inside and outside `Engine.gathered`), exit-rank<r> (the exit code
it is about to return), group-rank<r> ("ended" when the process group was destroyed by
the time the interpreter ran its exit handlers, else "alive"; then the number of gloo worker
threads still running: 0 when nothing held the group past its end). Under torchrun each process also records, in writes-rank<r>.json, every
file under <output_dir> it opened for writing or renamed into place (an audit hook), so a test
can check that each file has one writer. Rank 0 also writes logits.pt, the trained model's logits
on a fixed input (through the sharded model under fsdp).
"""

import atexit
import json
import os
import re
import sys
import time

import torch

WORKER_FILES = re.compile(r"(questions|summary|bytes|reductions|roles|lean|writes|pid|exit|parked"
                          r"|stop|group|rewarded)-rank\d+(\.json)?|logits\.pt")   # this helper's, not the trainer's
TRAINER = None   # the running trainer (the park hook reads its stop flag)
PARK: dict = {}
REWARDED: list = []   # each reward call's (prompt, completion) texts, in order


def length_reward(prompts, completions, completion_ids=None, **kw):
    park()
    REWARDED.append([[str(p), str(c)] for p, c in zip(prompts, completions)])
    return [float(len(c) % 2) + 0.1 * (len(c) % 3) for c in completions]


def park() -> None:
    rank, step = PARK.get("at", (None, None))
    if TRAINER is None or TRAINER.dist.rank != rank or TRAINER.run_state.step != step or PARK.get("done"):
        return
    PARK["done"] = True
    out = TRAINER.args.output_dir
    with open(os.path.join(out, f"parked-rank{rank}"), "w") as fh:
        fh.write(str(step))
    deadline = time.monotonic() + 300
    while not (TRAINER.stop_requested or os.path.exists(os.path.join(out, f"stop-rank{rank}"))) \
            and time.monotonic() < deadline:
        time.sleep(0.02)


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


def record_writes(output_dir: str) -> list:
    """An audit hook that lists the files under output_dir this process opens for writing
    (Python's open, torch.save, torch.distributed.checkpoint) or renames / replaces into place."""
    root = os.path.realpath(output_dir) + os.sep
    writes: list = []

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
                (isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
        elif event in ("os.rename", "os.replace"):
            path, writing = args[1], True
        else:
            return
        if writing and isinstance(path, (str, bytes, os.PathLike)):
            full = os.path.realpath(os.fsdecode(path))
            if full.startswith(root):
                writes.append(full[len(root):])
    sys.addaudithook(hook)
    return writes


def run(spec: dict) -> dict:
    global TRAINER
    from cppo.config import CPPOConfig
    from cppo.parallel.engines import local_bytes
    from cppo.trainer import CPPOTrainer
    out = spec["config"]["output_dir"]
    if spec.get("plain_init"):
        from cppo.parallel import processes
        processes.start_group = lambda backend, environ=None: \
            torch.distributed.init_process_group(backend=backend)
    trainer = TRAINER = CPPOTrainer(model=spec["model"], reward_funcs=[length_reward],
                                    args=CPPOConfig(**spec["config"]), train_dataset=spec["rows"])
    rank = trainer.dist.rank
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"pid-rank{rank}"), "w") as fh:
        fh.write(str(os.getpid()))
    first_start = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    PARK.clear()
    if spec.get("park_at_step") and first_start:
        PARK["at"] = tuple(spec["park_at_step"])
    reductions = count_reductions(trainer)
    drawn = []
    take = trainer.take_questions
    round_ = trainer.training_round

    def record():
        rows, order, skipped = take()
        drawn.append([r["prompt"] for r in rows])
        return rows, order, skipped

    def maybe_raise():
        if spec.get("raise_at_step") == [rank, trainer.run_state.step]:
            raise RuntimeError(f"deliberate failure on rank {rank} at step {trainer.run_state.step}")
        return round_()
    trainer.take_questions = record
    trainer.training_round = maybe_raise
    summary = trainer.train()
    reductions["optimizer_steps"] = summary["steps"] - summary["skipped_steps"]
    roles = {"rank": rank, "local_rank": trainer.dist.local_rank,
             "is_world_process_zero": trainer.callbacks.state.is_world_process_zero,
             "is_local_process_zero": trainer.callbacks.state.is_local_process_zero}
    for name, value in (("questions", drawn), ("summary", summary), ("reductions", reductions),
                        ("rewarded", REWARDED),
                        ("bytes", local_bytes(trainer.policy, trainer.optimizer)),
                        ("roles", roles)):
        with open(os.path.join(out, f"{name}-rank{rank}.json"), "w") as fh:
            json.dump(value, fh)
    if spec.get("post_run", True):
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


def record_group_state(out: str) -> None:
    """At exit, after the trainer's handler: is the process group still up? (group-rank<r>)"""
    import torch.distributed as dist
    from cppo.parallel.processes import collective_threads
    if TRAINER is None:   # failed before the trainer was built: nothing to record
        return
    with open(os.path.join(out, f"group-rank{TRAINER.dist.rank}"), "w") as fh:
        fh.write(f"{'alive' if dist.is_initialized() else 'ended'}, "
                 f"gloo threads: {collective_threads()}")


def main(path: str) -> int:
    """Under torchrun: one run, then the exit code `cppo train` would give. The process group
    is left to the trainer's exit handler, as a script that never calls close() leaves it."""
    from cppo.trainer import EXIT_CODES
    torch.set_num_threads(1)
    with open(path) as fh:
        spec = json.load(fh)
    out = spec["config"]["output_dir"]
    os.makedirs(out, exist_ok=True)
    writes = record_writes(out)
    atexit.register(record_group_state, out)   # runs after the trainer's own exit handler
    summary = run(spec)
    rank = TRAINER.dist.rank
    code = EXIT_CODES[summary["status"]]
    with open(os.path.join(out, f"writes-rank{rank}.json"), "w") as fh:
        json.dump([w for w in writes if not WORKER_FILES.fullmatch(w)], fh)
    with open(os.path.join(out, f"exit-rank{rank}"), "w") as fh:
        fh.write(str(code))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
