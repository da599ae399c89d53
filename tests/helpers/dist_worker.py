"""One CPPO run for tests/test_distributed.py: under torchrun (N processes) or in-process (1).

    python -m torch.distributed.run --nproc_per_node 2 tests/helpers/dist_worker.py spec.json

spec.json: {"config": {...CPPOConfig fields...}, "rows": [...], "model": dir}. Each process writes
the questions it drew to <output_dir>/questions-rank<r>.json; rank 0 writes the checkpoint.
"""

import json
import os
import sys

import torch


def mixed_length_reward(prompts, completions, completion_ids=None, **kw):
    """Rewards with more than two values (unlike helpers.odd_length_reward), so that batch-std
    scaling differs from group scaling."""
    return [float(len(c) % 2) + 0.1 * (len(c) % 3) for c in completions]


def run(spec: dict) -> dict:
    from cppo.config import CPPOConfig
    from cppo.trainer import CPPOTrainer
    trainer = CPPOTrainer(model=spec["model"], reward_funcs=[mixed_length_reward],
                          args=CPPOConfig(**spec["config"]), train_dataset=spec["rows"])
    drawn = []
    take = trainer.take_questions

    def record():
        rows = take()
        drawn.append([r["prompt"] for r in rows])
        return rows
    trainer.take_questions = record
    summary = trainer.train()
    out = os.path.join(spec["config"]["output_dir"], f"questions-rank{trainer.dist.rank}.json")
    with open(out, "w") as fh:
        json.dump(drawn, fh)
    return summary


if __name__ == "__main__":
    torch.set_num_threads(1)
    with open(sys.argv[1]) as fh:
        run(json.load(fh))
