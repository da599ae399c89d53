"""Data parallelism: 2 processes (torchrun, gloo on CPU) x B/2 questions make the same update as
1 process x B, and launch modes the trainer cannot run are refused clearly."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import ROWS, dist_worker
from cppo.distributed import Distributed, UnsupportedLauncherError, check_launcher

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spec(model_dir, output_dir, *, batch: int, scope: str) -> dict:
    config = dict(output_dir=str(output_dir), per_device_train_batch_size=batch, num_generations=4,
                  pruning_rate=0.5, selection_scope=scope, scale_rewards="batch", beta=0.04,
                  num_iterations=2, max_steps=4, generation_chunk_size=8, max_completion_length=5,
                  learning_rate=1e-3, eval_steps=0, save_steps=0, progress_bar=False, seed=3)
    return {"config": config, "rows": ROWS, "model": model_dir}


def records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "reward" in r]


def test_two_processes_make_the_same_step_as_one(tiny_model_dir, tmp_path):
    # 1 process x 4 questions (8 kept of 16, pruned over the step)
    one = tmp_path / "one"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dist_worker.run(spec(tiny_model_dir, one, batch=8, scope="step"))
    finally:
        torch.set_num_threads(threads)
    # 2 processes x 2 questions (8 kept of 16, pruned over both processes: selection_scope=global)
    two = tmp_path / "two"
    spec_file = tmp_path / "two.json"
    spec_file.write_text(json.dumps(spec(tiny_model_dir, two, batch=4, scope="global")))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("WORLD_SIZE", None)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--nnodes", "1",
               "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
               str(Path(dist_worker.__file__)), str(spec_file)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    # each process drew its own half of the same global question order
    drawn = [json.loads((two / f"questions-rank{r}.json").read_text()) for r in (0, 1)]
    single = json.loads((one / "questions-rank0.json").read_text())
    assert len(single) == 2 and all(len(q) == 4 for q in single)
    for step, questions in enumerate(single):
        assert drawn[0][step] + drawn[1][step] == questions
    # global metrics on rank 0 equal the single process's (rewards gathered over processes)
    for a, b in zip(records(one), records(two)):
        assert a["reward"] == pytest.approx(b["reward"]) and a["reward_std"] == pytest.approx(b["reward_std"])
    # rank 0 alone wrote the checkpoint; its parameters equal the 1-process ones
    single_state = load_file(one / "checkpoint-4" / "model.safetensors")
    multi_state = load_file(two / "checkpoint-4" / "model.safetensors")
    initial = load_file(Path(tiny_model_dir) / "model.safetensors")
    moved = max(float((single_state[k] - initial[k]).abs().max()) for k in initial)
    assert moved > 1e-3                                      # the steps really changed the model
    for name, value in single_state.items():
        torch.testing.assert_close(multi_state[name], value, rtol=1e-4, atol=2e-5, msg=name)
    assert sorted(p.name for p in two.iterdir() if p.name.startswith("checkpoint")) == ["checkpoint-4"]


@pytest.mark.parametrize("variable", ["ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"])
def test_fsdp_and_deepspeed_launches_are_refused(variable):
    with pytest.raises(UnsupportedLauncherError, match="examples/accelerate/ddp.yaml"):
        check_launcher({variable: "true"})
    check_launcher({variable: "false"})


def test_one_process_is_a_no_op():
    d = Distributed()
    t = torch.arange(6.0).view(3, 2)
    assert d.sum(3) == 3 and d.gather(t) is t and not d.any(False) and d.any(True)
    assert torch.equal(d.group_advantages(t, "batch"),
                       __import__("cppo.algorithm", fromlist=["x"]).group_advantages(t, "batch"))
