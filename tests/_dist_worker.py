"""One CPPO run for tests/test_distributed.py: under torchrun (N processes) or in-process (1).

    python -m torch.distributed.run --nproc_per_node 2 tests/_dist_worker.py spec.json

spec.json: {"config": {...CPPOConfig fields...}, "rows": [...], "model": dir}. Each process writes
to <output_dir>: questions-rank<r>.json (the questions it drew), summary-rank<r>.json (train()'s
summary), bytes-rank<r>.json (the parameter, gradient and optimizer bytes it holds at the end)
and pid-rank<r> (its process id, written before training); rank 0 also writes logits.pt, the
trained model's logits on a fixed input (through the sharded model under fsdp).
"""

import json
import os
import sys

import torch


def length_reward(prompts, completions, completion_ids=None, **kw):
    return [float(len(c) % 2) + 0.1 * (len(c) % 3) for c in completions]


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
    drawn = []
    take = trainer.take_questions

    def record():
        rows = take()
        drawn.append([r["prompt"] for r in rows])
        return rows
    trainer.take_questions = record
    summary = trainer.train()
    for name, value in (("questions", drawn), ("summary", summary),
                        ("bytes", local_bytes(trainer.policy, trainer.optimizer))):
        with open(os.path.join(out, f"{name}-rank{rank}.json"), "w") as fh:
            json.dump(value, fh)
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
