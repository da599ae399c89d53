"""Scale-out through torch's engines (2 gloo processes under torchrun on CPU).

`distributed: fsdp` (FSDP2, sharded) and `distributed: ddp` (DistributedDataParallel), each with
2 processes x B/2 questions, end with the same parameters, logged loss and grad_norm as 1
process x B (beta > 0, mu = 2, global selection, batch-scaled rewards, gradient accumulation 2);
under fsdp each process holds half the bytes; a SIGKILL mid-run then --resume ends identical; a
Ctrl-C on one process stops both with a checkpoint; the consolidated export loads with
from_pretrained and gives the trained model's logits. Launches the trainer cannot run fail
clearly before training.
"""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import ROWS, closeness, note_margin
from helpers import dist_worker as _dist_worker
from cppo.run import checkpoint as ckpt
from cppo.algorithm import group_advantages, plan_step
from cppo.config import CPPOConfig
from cppo.errors import ConfigError
from cppo.parallel.processes import Distributed, check_launcher
from cppo.parallel.processes import free_port
from cppo.parallel.engines import block_classes, check_layout, launcher_strategy
from cppo.errors import ShardingError

STEPS = 4   # 2 generation rounds x mu = 2 optimizer steps


def spec(model_dir, output_dir, *, batch: int, scope: str, strategy: str = "ddp", **extra) -> dict:
    config = dict(output_dir=str(output_dir), per_device_train_batch_size=batch,
                  gradient_accumulation_steps=2, num_generations=4, pruning_rate=0.5,
                  selection_scope=scope, scale_rewards="batch", beta=0.04, num_iterations=2,
                  max_steps=STEPS, generation_chunk_size=8, max_completion_length=5,
                  learning_rate=1e-3, eval_steps=0, save_steps=2, progress_bar=False, seed=3,
                  distributed=strategy, adam_epsilon=1e-4)   # see test_two_processes_make_the_same_steps_as_one
    hooks = {k: extra.pop(k) for k in ("raise_at_step", "park_at_step", "post_run") if k in extra}
    config.update(extra)
    return {"config": config, "rows": ROWS, "model": model_dir, **hooks}


STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True, scope="module")
def _no_process_left_behind():
    """A failed or timed-out test must not leave its torchrun group running."""
    yield
    for proc in STARTED:
        if proc.poll() is None:   # torchrun's workers run in sessions of their own: them first
            for child in Path("/proc").glob("[0-9]*"):
                try:
                    if parent_pid(int(child.name)) == proc.pid:
                        os.kill(int(child.name), signal.SIGKILL)
                except (OSError, ValueError, IndexError):
                    pass
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def torchrun(spec_dict: dict, spec_file: Path, *, env: dict | None = None, wait: bool = True,
             launcher: tuple = ("--nproc_per_node", "2", "--nnodes", "1"), log: Path | None = None):
    """Launch dist_worker under torchrun (2 processes on one node unless `launcher` says
    otherwise); with wait, assert it exits 0: a finished run ends cleanly."""
    spec_file.write_text(json.dumps(spec_dict))
    environ = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
               # the launcher's grace between its SIGTERM and SIGKILL (default 30 s): room for
               # a step on a loaded machine
               "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "120", **(env or {})}
    environ.pop("WORLD_SIZE", None)
    rendezvous = [] if "--rdzv_backend" in launcher else \
        ["--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    command = [sys.executable, "-m", "torch.distributed.run", *launcher, *rendezvous,
               str(Path(_dist_worker.__file__)), str(spec_file)]
    log = log or spec_file.with_suffix(".log")
    proc = subprocess.Popen(command, env=environ, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)   # its own process group: killed as a whole
    STARTED.append(proc)
    if not wait:
        return proc, log
    assert proc.wait(timeout=300) == 0, log.read_text()[-4000:]
    return proc, log


def two_nodes(spec_dict: dict, root: Path, name: str, wait: bool = True):
    """The same run as 2 "nodes" of 1 process each, as a cluster launches it: one torchrun per
    node, a c10d rendezvous on 127.0.0.1 (rank order is the order the nodes join)."""
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [torchrun(spec_dict, root / f"{name}-node{n}.json", wait=False,
                      log=root / f"{name}-node{n}.log",
                      launcher=("--nnodes", "2", "--nproc_per_node", "1", "--node_rank", str(n),
                                "--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint,
                                "--rdzv_id", name))
             for n in (0, 1)]
    if wait:
        for proc, log in nodes:
            assert proc.wait(timeout=300) == 0, log.read_text()[-4000:]
    return nodes


def wait_for(path: Path, procs: list, logs: list, timeout_s: float = 240) -> None:
    deadline = time.time() + timeout_s
    while not path.exists():
        for proc, log in zip(procs, logs):
            assert proc.poll() is None, log.read_text()[-3000:]
        assert time.time() < deadline, f"timed out waiting for {path}"
        time.sleep(0.1)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def parent_pid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def assert_same_run(run: Path, reference: Path) -> None:
    """The same logged steps and bit-identical final weights as the reference run."""
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in records(run)] == \
        [(r["step"], r["loss"], r["grad_norm"]) for r in records(reference)]
    expected, got = final_weights(reference), final_weights(run)
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


def records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "reward" in r]


def final_weights(run_dir: Path) -> dict:
    return load_file(run_dir / f"checkpoint-{STEPS}" / "model.safetensors")


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    """{name: run dir} for 1 process x 4 questions and 2 processes x 2 (fsdp, ddp)."""
    root = tmp_path_factory.mktemp("dist")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:   # 8 kept of 16 per step, pruned over the step
        _dist_worker.run(spec(tiny_model_dir, root / "one", batch=4, scope="step"))
    finally:
        torch.set_num_threads(threads)
    out = {"one": root / "one"}
    for strategy in ("fsdp", "ddp"):   # 8 kept of 16, pruned over both processes
        torchrun(spec(tiny_model_dir, root / strategy, batch=2, scope="global", strategy=strategy),
                 root / f"{strategy}.json")
        out[strategy] = root / strategy
    return out


@pytest.mark.cpu_paths
@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_two_processes_make_the_same_steps_as_one(runs, strategy, tiny_model_dir):
    one, two = runs["one"], runs[strategy]
    # each process drew its own half of the same global question order
    drawn = [json.loads((two / f"questions-rank{r}.json").read_text()) for r in (0, 1)]
    single = json.loads((one / "questions-rank0.json").read_text())
    for step, questions in enumerate(single):
        assert drawn[0][step] + drawn[1][step] == questions
    # the logged loss, grad_norm (before clipping), kl and rewards are those of the global batch:
    # a gradient scaled by 2 doubles grad_norm, which clipping would hide in the parameters
    a, b = records(one), records(two)
    assert len(a) == len(b) == STEPS // 2
    for x, y in zip(a, b):
        for key in ("loss", "grad_norm", "kl", "reward", "reward_std", "clip_ratio/region_mean"):
            assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-6), (key, x[key], y[key])
    single, multi = final_weights(one), final_weights(two)
    initial = load_file(Path(tiny_model_dir) / "model.safetensors")
    assert max(float((single[k] - initial[k]).abs().max()) for k in initial) > 1e-3   # it moved
    assert sorted(multi) == sorted(single)
    # float32 rounding differs with the per-process batch (attention's batched matmuls, the
    # reduce-scatter's order): ~1e-7 of a gradient. AdamW moves a parameter by at most lr / eps
    # per unit of gradient difference, 10 with eps 1e-4 (1e5 with torch's 1e-8, where a gradient
    # entry near 1e-8 turns round-off into a move of order lr on any CPU), so the weights agree
    # to ~1e-6 after 4 steps; a lost or extra share of the batch moves them by ~lr (1e-3)
    note_margin("one_vs_two_processes", weights=max(closeness(multi[n], v, atol=1e-5, rtol=1e-4)
                                                    for n, v in single.items()), weights_bound=1.0)
    for name, value in single.items():
        torch.testing.assert_close(multi[name], value, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_gradients_are_reduced_once_per_optimizer_step(runs, strategy):
    # gradient accumulation 2: at least 2 micro-batches per step, but one reduction per step
    # (fsdp: one reduce-scatter per shard group: 2 decoder blocks + the root; ddp: one bucket)
    groups = {"fsdp": 3, "ddp": 1}[strategy]
    for rank in (0, 1):
        counted = json.loads((runs[strategy] / f"reductions-rank{rank}.json").read_text())
        assert counted["optimizer_steps"] == STEPS
        assert counted["reductions"] == groups * STEPS, counted


def test_fsdp_generation_runs_the_lean_forward_on_the_gathered_weights(runs):
    for rank in (0, 1):
        lean = json.loads((runs["fsdp"] / f"lean-rank{rank}.json").read_text())
        assert lean["gathered"] is None                   # gathered: the lean forward runs
        assert "sharded" in lean["outside"]               # sharded: the model's own forward


@pytest.fixture(scope="module")
def lora_runs(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("dist_lora")
    lora = dict(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0,
                lora_target_modules=["q_proj", "v_proj"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _dist_worker.run(spec(tiny_model_dir, root / "one", batch=4, scope="step", **lora))
    finally:
        torch.set_num_threads(threads)
    torchrun(spec(tiny_model_dir, root / "fsdp", batch=2, scope="global", strategy="fsdp", **lora),
             root / "fsdp.json")
    return {"one": root / "one", "fsdp": root / "fsdp"}


def test_lora_under_fsdp_makes_the_same_steps_as_one_process(lora_runs):
    a, b = records(lora_runs["one"]), records(lora_runs["fsdp"])
    assert len(a) == len(b) == STEPS // 2
    for x, y in zip(a, b):
        for key in ("loss", "grad_norm", "kl"):
            assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-6), (key, x[key], y[key])
    final = f"checkpoint-{STEPS}/adapter_model.safetensors"   # the export: peft's adapter folder
    single, multi = load_file(lora_runs["one"] / final), load_file(lora_runs["fsdp"] / final)
    assert sorted(multi) == sorted(single)
    for name, value in single.items():
        torch.testing.assert_close(multi[name], value, rtol=1e-4, atol=2e-6, msg=name)


def test_fsdp_with_bf16_gathers_bfloat16_weights_and_keeps_fp32_masters(runs, tiny_model_dir,
                                                                        tmp_path):
    run = tmp_path / "bf16"
    torchrun(spec(tiny_model_dir, run, batch=2, scope="global", strategy="fsdp", bf16=True,
                  max_steps=2), tmp_path / "bf16.json")
    lean = json.loads((run / "lean-rank0.json").read_text())
    assert lean["gathered_dtype"] == "torch.bfloat16" and lean["gathered"] is None
    assert all(v.dtype == torch.float32 for v in load_file(run / "checkpoint-2" / "model.safetensors").values())
    fp32 = records(runs["fsdp"])[0]    # the same first step in fp32: equal up to bf16 rounding
    bf16 = records(run)[0]
    for key in ("loss", "grad_norm"):
        assert bf16[key] == pytest.approx(fp32[key], rel=2e-2), key
    fp32_lean = json.loads((runs["fsdp"] / "lean-rank0.json").read_text())
    assert fp32_lean["gathered_dtype"] == "torch.float32"


def test_fsdp_processes_each_hold_half_of_the_state(runs):
    whole = json.loads((runs["one"] / "bytes-rank0.json").read_text())
    shards = [json.loads((runs["fsdp"] / f"bytes-rank{r}.json").read_text()) for r in (0, 1)]
    replicas = [json.loads((runs["ddp"] / f"bytes-rank{r}.json").read_text()) for r in (0, 1)]
    for kind in ("parameters", "gradients", "optimizer"):
        assert whole[kind] > 0
        assert sum(s[kind] for s in shards) == whole[kind]            # nothing held twice
        for s in shards:
            assert 0.4 * whole[kind] <= s[kind] <= 0.6 * whole[kind], (kind, s, whole)
        assert all(r[kind] == whole[kind] for r in replicas)          # ddp: whole copies


def test_fsdp_checkpoints_are_sharded_and_the_export_loads(runs):
    from transformers import AutoModelForCausalLM
    run = runs["fsdp"]
    final = run / f"checkpoint-{STEPS}"
    assert sorted(p.name for p in (final / "sharded").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert not (final / "optimizer.pt").exists()          # the optimizer state is in the shards
    assert not (run / "checkpoint-2" / "model.safetensors").exists()   # consolidated: final only
    saved = torch.load(run / "logits.pt")
    model = AutoModelForCausalLM.from_pretrained(final)
    assert model.config.architectures == ["LlamaForCausalLM"]
    with torch.no_grad():
        logits = model(input_ids=saved["input_ids"]).logits
    torch.testing.assert_close(logits, saved["logits"], rtol=1e-5, atol=1e-5)


def test_sigkill_mid_run_then_resume_ends_identical(runs, tiny_model_dir, tmp_path):
    # killed while writing the final checkpoint (shards and export written, not yet renamed)
    run = tmp_path / "killed"
    config = spec(tiny_model_dir, run, batch=2, scope="global", strategy="fsdp")
    proc, log = torchrun(config, tmp_path / "killed.json", wait=False,
                         env={ckpt.PAUSE_ENV: f"weights:{STEPS}"})
    deadline = time.time() + 240
    while f"{ckpt.PAUSE_ENV} weights {STEPS}" not in log.read_text():
        assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    for rank in (0, 1):   # torchrun's workers run in sessions of their own: kill them too
        os.kill(int((run / f"pid-rank{rank}").read_text()), signal.SIGKILL)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert ckpt.latest_checkpoint(run) == run / "checkpoint-2"   # the previous one, loadable
    config["config"]["resume"] = True
    _, log = torchrun(config, tmp_path / "resume.json")
    assert "resumed from" in log.read_text()
    assert_same_run(run, runs["fsdp"])


def test_ctrl_c_on_one_process_stops_both_with_a_checkpoint(tiny_model_dir, tmp_path):
    run = tmp_path / "interrupted"
    config = spec(tiny_model_dir, run, batch=2, scope="global", strategy="fsdp", max_steps=400,
                  save_steps=0)
    proc, log = torchrun(config, tmp_path / "ctrl_c.json", wait=False)
    deadline = time.time() + 240
    while not ((run / "metrics.jsonl").is_file() and records(run)):
        assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    os.kill(int((run / "pid-rank1").read_text()), signal.SIGINT)   # rank 1 only
    assert proc.wait(timeout=240) == 0, log.read_text()[-3000:]
    summaries = [json.loads((run / f"summary-rank{r}.json").read_text()) for r in (0, 1)]
    assert [s["status"] for s in summaries] == ["interrupted", "interrupted"]
    steps = summaries[0]["steps"]
    assert summaries[1]["steps"] == steps and 0 < steps < 400
    assert ckpt.latest_checkpoint(run) == run / f"checkpoint-{steps}"
    assert (run / f"checkpoint-{steps}" / "sharded").is_dir()


# --- ending: exit codes, SIGTERM, nodes, restarts -------------------------------------------------
@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_each_file_has_one_writer_and_the_ranks_know_their_roles(runs, strategy):
    writes = [json.loads((runs[strategy] / f"writes-rank{r}.json").read_text()) for r in (0, 1)]
    assert "metrics.jsonl" in writes[0] and any(w.endswith("COMPLETE") for w in writes[0])
    assert not set(writes[0]) & set(writes[1])
    # rank 1 writes only its own shards (fsdp), nothing under ddp
    assert all(w.endswith("/sharded/__1_0.distcp") for w in writes[1]), writes[1]
    assert bool(writes[1]) == (strategy == "fsdp")
    roles = [json.loads((runs[strategy] / f"roles-rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["local_rank"], r["is_world_process_zero"], r["is_local_process_zero"])
            for r in roles] == [(0, True, True), (1, False, False)]
    assert [int((runs[strategy] / f"exit-rank{r}").read_text()) for r in (0, 1)] == [0, 0]
    # the trainer ended its process group before interpreter shutdown (an exit handler: the
    # worker never calls close()), after the engine let go of it (DDP's reducer, FSDP's states
    # and meshes), so gloo's threads were joined then: none is left to abort the process at exit
    assert [(runs[strategy] / f"group-rank{r}").read_text() for r in (0, 1)] == \
        ["ended, gloo threads: 0"] * 2


def test_a_raising_rank_ends_every_rank_with_a_non_zero_code(tiny_model_dir, tmp_path):
    run = tmp_path / "raising"
    config = spec(tiny_model_dir, run, batch=2, scope="global", strategy="fsdp",
                  raise_at_step=[1, 2])    # rank 1 fails after checkpoint-2, rank 0 does not
    proc, log = torchrun(config, tmp_path / "raising.json", wait=False)
    code = proc.wait(timeout=240)          # never a hang: rank 0 is not left waiting
    text = log.read_text()
    assert code != 0 and "deliberate failure on rank 1 at step 2" in text, text[-3000:]
    assert all(gone(int((run / f"pid-rank{r}").read_text())) for r in (0, 1))
    assert not (run / "summary.json").exists()
    assert ckpt.latest_checkpoint(run) == run / "checkpoint-2"


@pytest.mark.parametrize("target", ["rank", "agent"])
def test_sigterm_stops_both_ranks_after_the_step_then_resume_is_identical(runs, tiny_model_dir,
                                                                          tmp_path, target):
    """SIGTERM to rank 1 while it is inside step 1 (parked in its reward call), or to the
    torchrun agent (which sends it on to both): both finish the step, save checkpoint-2 and exit
    143; --resume then ends exactly as the uninterrupted run."""
    run = tmp_path / "terminated"
    config = spec(tiny_model_dir, run, batch=2, scope="global", strategy="fsdp",
                  park_at_step=[1, 0])
    proc, log = torchrun(config, tmp_path / "sigterm.json", wait=False)
    wait_for(run / "parked-rank1", [proc], [log])
    os.kill(proc.pid if target == "agent" else int((run / "pid-rank1").read_text()),
            signal.SIGTERM)
    assert proc.wait(timeout=240) != 0, log.read_text()[-3000:]   # workers exited 143: not done
    summaries = [json.loads((run / f"summary-rank{r}.json").read_text()) for r in (0, 1)]
    assert [(s["status"], s["steps"]) for s in summaries] == [("terminated", 2)] * 2
    assert [int((run / f"exit-rank{r}").read_text()) for r in (0, 1)] == [143, 143]
    assert ckpt.latest_checkpoint(run) == run / "checkpoint-2"
    config["config"]["resume"], config["park_at_step"] = True, None
    torchrun(config, tmp_path / "resume.json")
    assert_same_run(run, runs["fsdp"])


def test_two_nodes_train_like_one_node_and_write_each_file_once(runs, tiny_model_dir, tmp_path):
    run = tmp_path / "nodes"
    two_nodes(spec(tiny_model_dir, run, batch=2, scope="global", strategy="fsdp"), tmp_path, "nodes")
    assert_same_run(run, runs["fsdp"])
    roles = sorted((json.loads((run / f"roles-rank{r}.json").read_text()) for r in (0, 1)),
                   key=lambda r: r["rank"])
    assert [(r["local_rank"], r["is_world_process_zero"], r["is_local_process_zero"])
            for r in roles] == [(0, True, True), (0, False, True)]   # each node's first process
    writes = [json.loads((run / f"writes-rank{r}.json").read_text()) for r in (0, 1)]
    assert not set(writes[0]) & set(writes[1])
    assert writes[1] and all(w.endswith("/sharded/__1_0.distcp") for w in writes[1]), writes[1]


def test_a_killed_node_then_resume_ends_identical(runs, tiny_model_dir, tmp_path):
    run = tmp_path / "node_killed"
    config = spec(tiny_model_dir, run, batch=2, scope="global", strategy="fsdp",
                  park_at_step=[1, 2])    # rank 1 waits inside step 3, after checkpoint-2
    nodes = two_nodes(config, tmp_path, "killed", wait=False)
    wait_for(run / "parked-rank1", *zip(*nodes))
    worker = int((run / "pid-rank1").read_text())
    agent = parent_pid(worker)   # the node that holds rank 1: its agent and its worker die
    assert agent in [proc.pid for proc, _ in nodes]
    os.killpg(agent, signal.SIGKILL)
    os.kill(worker, signal.SIGKILL)
    for proc, log in nodes:
        assert proc.wait(timeout=240) != 0
    assert gone(int((run / "pid-rank0").read_text()))
    assert ckpt.latest_checkpoint(run) == run / "checkpoint-2"
    config["config"]["resume"], config["park_at_step"] = True, None
    two_nodes(config, tmp_path, "resumed")
    assert_same_run(run, runs["fsdp"])


@pytest.mark.parametrize("rendezvous", ["static", "c10d"])
def test_a_restart_by_torchrun_resumes_and_ends_identical(runs, tiny_model_dir, tmp_path,
                                                          rendezvous):
    """torchrun --max-restarts 1 (static rendezvous, or c10d): rank 1 is SIGKILLed inside step
    3; the launcher restarts both in place on the store it kept, their group meets under keys of
    its own start (not the killed group's), they resume from checkpoint-2 without --resume, and
    the run completes (exit 0) with the weights of the uninterrupted run."""
    run = tmp_path / "restarted"
    config = spec(tiny_model_dir, run, batch=2, scope="global", strategy="fsdp",
                  park_at_step=[1, 2])
    launcher = ("--nproc_per_node", "2", "--nnodes", "1", "--max-restarts", "1")
    if rendezvous == "c10d":
        launcher += ("--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{free_port()}")
    proc, log = torchrun(config, tmp_path / "restart.json", wait=False, launcher=launcher)
    wait_for(run / "parked-rank1", [proc], [log])
    os.kill(int((run / "pid-rank1").read_text()), signal.SIGKILL)
    assert proc.wait(timeout=300) == 0, log.read_text()[-4000:]
    assert "restart 1 by the launcher: resuming" in log.read_text()
    assert json.loads((run / "summary.json").read_text())["resumed_from"].endswith("checkpoint-2")
    assert_same_run(run, runs["fsdp"])


def test_a_rendezvous_that_never_completes_names_the_endpoint_and_the_timeout(monkeypatch):
    """WORLD_SIZE=2 with one process: it hosts the store, the other never comes, and it fails
    after CPPO_RENDEZVOUS_TIMEOUT seconds, naming the store's host:port and the seconds; no
    process group is left started."""
    from cppo.parallel.processes import RendezvousTimeout
    port = free_port()
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                        "CPPO_RENDEZVOUS_TIMEOUT": "1.5"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    with pytest.raises(RendezvousTimeout, match=rf"127\.0\.0\.1:{port} .*1\.5 s.*1 of 2"):
        Distributed.from_environment()
    assert not torch.distributed.is_initialized()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")   # torchrun's store, not there
    with pytest.raises(RendezvousTimeout, match=rf"could not reach .*127\.0\.0\.1:{port} .*1\.5 s"):
        Distributed.from_environment()
    monkeypatch.setenv("CPPO_RENDEZVOUS_TIMEOUT", "soon")
    with pytest.raises(ConfigError, match="CPPO_RENDEZVOUS_TIMEOUT"):
        Distributed.from_environment()


def test_a_corrupt_or_missing_newest_checkpoint_falls_back_to_the_one_before(runs, tiny_model_dir,
                                                                             tmp_path):
    """A restart whose newest checkpoint is damaged resumes from the one before it and says
    so: a truncated shard (fsdp), a truncated model file, a missing state file or COMPLETE
    marker; the resumed run (1 process, truncated model of checkpoint-4) ends identical."""
    import shutil
    said = []

    def say(*parts, **_):
        said.append(" ".join(map(str, parts)))

    def damaged(source: Path, name: str, damage) -> Path:
        run = tmp_path / name
        shutil.copytree(source, run)
        damage(run / f"checkpoint-{STEPS}")
        return run

    def truncate(path: Path) -> None:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

    cases = {
        "shard": (runs["fsdp"], lambda c: truncate(c / "sharded" / "__1_0.distcp"), "__1_0.distcp"),
        "model": (runs["one"], lambda c: truncate(c / "model.safetensors"), "model.safetensors"),
        "rng": (runs["one"], lambda c: (c / "rng_state.pt").unlink(), "rng_state.pt is missing"),
        "marker": (runs["one"], lambda c: (c / "COMPLETE").unlink(), "no COMPLETE marker"),
    }
    for name, (source, damage, why) in cases.items():
        said.clear()
        run = damaged(source, name, damage)
        assert ckpt.latest_checkpoint(run, say=say) == run / "checkpoint-2", name
        assert len(said) == 1 and f"checkpoint-{STEPS}" in said[0] and why in said[0] \
            and "falling back to checkpoint-2" in said[0], said
        assert (run / f"checkpoint-{STEPS}").is_dir()          # left in place for the next save
    assert ckpt.latest_checkpoint(runs["one"], say=say) == runs["one"] / f"checkpoint-{STEPS}"
    config = spec(tiny_model_dir, tmp_path / "model", batch=4, scope="step", resume=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        summary = _dist_worker.run(config)
    finally:
        torch.set_num_threads(threads)
    assert summary["resumed_from"].endswith("checkpoint-2")
    assert_same_run(tmp_path / "model", runs["one"])


# --- bad input: clear errors before training ----------------------------------------------------
def test_deepspeed_and_fsdp_v1_launches_are_refused_and_fsdp_v2_selects_fsdp():
    with pytest.raises(ShardingError, match="examples/accelerate/fsdp.yaml"):
        check_launcher({"ACCELERATE_USE_DEEPSPEED": "true"})
    with pytest.raises(ShardingError, match="fsdp_version: 2"):
        launcher_strategy({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"})
    assert launcher_strategy({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}) == "fsdp"
    assert launcher_strategy({"ACCELERATE_USE_DEEPSPEED": "false"}) is None


def test_fsdp_names_the_field_when_no_block_class_is_found(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM
    from cppo.trainer import CPPOTrainer
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert [c.__name__ for c in block_classes(model)] == ["LlamaDecoderLayer"]
    with pytest.raises(ShardingError, match="fsdp_transformer_layer_cls_to_wrap"):
        block_classes(model, ["NoSuchBlock"])
    # before training: an earlier run's files in the run directory are left as they were
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("earlier\n")
    args = CPPOConfig(output_dir=str(run), distributed="fsdp", max_steps=1, num_generations=4,
                      per_device_train_batch_size=8, pruning_rate=0.5,
                      fsdp_transformer_layer_cls_to_wrap=["NoSuchBlock"], progress_bar=False)
    with pytest.raises(ShardingError, match="distributed: ddp"):
        CPPOTrainer(model=tiny_model_dir, reward_funcs=[_dist_worker.length_reward], args=args,
                    train_dataset=ROWS)
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]
    assert (run / "metrics.jsonl").read_text() == "earlier\n"


def test_a_step_the_processes_cannot_share_evenly_is_refused():
    plan = plan_step(completions_per_update=4, group_size=4, pruning_rate=0.5, allocation=True,
                     scope="step")   # 2 questions x 4 = 8 completions per process: chunks of 12 straddle
    layout = dict(generation_chunk_size=12, num_generations=4,
                  questions_per_step=plan.questions_per_step)
    check_layout(**layout, world_size=1)
    with pytest.raises(ConfigError, match="generation_chunk_size"):
        check_layout(**layout, world_size=2)
    check_layout(**{**layout, "generation_chunk_size": 8}, world_size=2)


def test_one_process_is_a_no_op():
    d = Distributed()
    t = torch.arange(6.0).view(3, 2)
    assert d.sum(3) == 3 and d.gather(t) is t and not d.any(False) and d.any(True)
    assert d.sum_values({"a": 1, "b": 2.5}) == {"a": 1, "b": 2.5}
    assert torch.equal(group_advantages(t, "batch", batch_rewards=d.gather(t)), group_advantages(t, "batch"))


class _TwoProcesses(Distributed):
    """A stand-in for 2 processes: this one has `rows`, the other `other` (gather only)."""

    def __init__(self, other: int) -> None:
        super().__init__(rank=0, world_size=2)
        self.other = other

    def gather(self, tensor):
        return torch.cat([tensor, torch.tensor([self.other])])


def test_filler_rows_align_the_processes_without_changing_the_loss():
    from cppo.algorithm import reduce_loss
    from cppo.parallel.engines import pad_rows
    from cppo.run.batch import StepBatch
    g = torch.Generator().manual_seed(0)
    batch = StepBatch(torch.randint(1, 9, (3, 4), generator=g), torch.ones(3, 4, dtype=torch.long),
                      torch.randint(1, 9, (3, 5), generator=g), torch.ones(3, 5, dtype=torch.long),
                      torch.randn(3, generator=g))
    assert pad_rows(batch, _TwoProcesses(other=2)) is batch          # the largest already
    padded = pad_rows(batch, _TwoProcesses(other=5))
    assert len(padded) == 5 and padded.filler_rows == 2
    assert torch.equal(padded.completion_ids[:3], batch.completion_ids)
    assert padded.prompt_mask[3:].all()                    # attended: finite log-probs
    assert not padded.completion_mask[3:].any() and not padded.advantages[3:].any()
    per_token = torch.randn(5, 5, generator=g)
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo"):
        kwargs = dict(max_completion_length=5, total_sequences=3, total_tokens=15)
        assert torch.allclose(reduce_loss(per_token, padded.completion_mask, loss_type, **kwargs),
                              reduce_loss(per_token[:3], batch.completion_mask, loss_type, **kwargs))
    empty = StepBatch(*(t[:0] for t in (batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                        batch.completion_mask, batch.advantages)))
    filled = pad_rows(empty, _TwoProcesses(other=2))      # a process that kept nothing
    assert len(filled) == 2 and filled.filler_rows == 2 and filled.prompt_mask.all()


def test_a_gather_that_cannot_fit_names_the_way_out(monkeypatch):
    from cppo.parallel.engines import check_gather_fits
    model = torch.nn.Linear(1000, 1000)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10_000, 10**12))
    with pytest.raises(ShardingError, match="use_vllm.*generation_chunk_size"):
        check_gather_fits(model, torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10**10, 10**12))
    check_gather_fits(model, torch.device("cuda", 0))
    check_gather_fits(model, torch.device("cpu"))          # CPU: nothing to check


def test_run_state_round_trips_and_reads_earlier_checkpoints():
    state = ckpt.RunState()
    state.step, state.history = 7, [{"step": 5, "accuracy": 0.5}]
    state.counters["skipped_steps"] = 2
    state.questions = {"epoch": 1, "position": 3}
    saved = json.loads(json.dumps(state.to_dict(config={"seed": 1}, world_size=2)))
    assert saved["world_size"] == 2 and saved["config"] == {"seed": 1}   # written, not read back
    assert ckpt.RunState.from_dict(saved) == state
    earlier = ckpt.RunState.from_dict({"step": 3, "wall_time": 12.5, "counters": {"skipped_steps": 1}})
    assert earlier.wall_offset == 12.5 and earlier.counters["tokens_generated"] == 0


# --- asynchronous rollouts under torchrun: 2 training processes, one generator process ----------
ASYNC_STEPS = 6   # 3 rounds x mu = 2


def async_spec(model_dir, output_dir, **extra) -> dict:
    """spec()'s 2-process ddp run in float64 over 3 rounds (float64: see
    test_async_rollout.test_max_staleness_0_is_the_synchronous_run), synchronous unless extra
    says async_rollout."""
    return spec(model_dir, output_dir, batch=2, scope="global", max_steps=ASYNC_STEPS,
                torch_dtype="float64", generation_dtype=None, matmul_dtype=None, **extra)


def weights_at(run_dir: Path, step: int) -> dict:
    return load_file(run_dir / f"checkpoint-{step}" / "model.safetensors")


def generator_pid(log: Path) -> int:
    import re
    return int(re.search(r"generator process \(pid (\d+)\)", log.read_text()).group(1))


@pytest.fixture(scope="module")
def async_runs(tiny_model_dir, tmp_path_factory):
    """{name: (run dir, torchrun log)}: sync, and async_rollout at max_staleness 0 (one generator
    process, and two) and 2."""
    root = tmp_path_factory.mktemp("async")
    out = {}
    for name, extra in (("sync", {}), ("async0", dict(async_rollout=True, max_staleness=0)),
                        ("async0_pool", dict(async_rollout=True, max_staleness=0,
                                             generator_processes=2, generator_cpus=[0, 1])),
                        ("async2", dict(async_rollout=True, max_staleness=2,
                                        pruning_rate="auto", pruning_rate_start=0.5,
                                        pruning_rate_min=0.25))):
        _, log = torchrun(async_spec(tiny_model_dir, root / name, **extra), root / f"{name}.json")
        out[name] = (root / name, log)
    return out


def test_async_rollout_with_two_trainers_at_max_staleness_0_is_the_synchronous_run(async_runs):
    """One generator process samples both processes' questions, each part as that process would
    (its own seeds and padding), and each process trains on its own part: the same questions per
    process, losses and weights (float64 round-off, 1e-10) as the synchronous 2-process run. A
    process given the other's part, or the whole round, changes the weights by far more."""
    (sync, _), (run, log) = async_runs["sync"], async_runs["async0"]
    assert "2 training processes" in log.read_text()
    for rank in (0, 1):
        assert json.loads((run / f"questions-rank{rank}.json").read_text()) == \
            json.loads((sync / f"questions-rank{rank}.json").read_text())
    assert_same_rewarded(sync, run)
    assert_same_training(sync, run)


def test_two_trainers_with_two_generator_processes_at_max_staleness_0_are_the_synchronous_run(
        async_runs):
    """generator_processes 2 under torchrun: each round's parts (a training process's generation
    chunks, whole) are shared between the two processes and merged back in order, and every push
    reaches both: the synchronous 2-process run's losses and weights (float64 round-off)."""
    (sync, _), (run, log) = async_runs["sync"], async_runs["async0_pool"]
    assert "2 generator processes" in log.read_text() and "2 training processes" in log.read_text()
    assert_same_rewarded(sync, run)
    assert_same_training(sync, run)


def assert_same_rewarded(sync: Path, run: Path) -> None:
    """Each process scored the same prompts and completions as in the synchronous run (the
    reward here reads only the completions' lengths, so parts swapped between processes would
    leave the losses and weights as they are: this catches them)."""
    for rank in (0, 1):
        assert json.loads((run / f"rewarded-rank{rank}.json").read_text()) == \
            json.loads((sync / f"rewarded-rank{rank}.json").read_text()), rank


def assert_same_training(sync: Path, run: Path) -> None:
    """The run's losses, gradient norms, KL and rewards are the synchronous run's to float64
    round-off, and its weights at the end to 1e-10 (the same parameters)."""
    a, b = records(sync), records(run)
    assert len(a) == len(b) == ASYNC_STEPS // 2
    for x, y in zip(a, b):
        for key in ("loss", "grad_norm", "kl", "reward"):
            assert y[key] == pytest.approx(x[key], rel=1e-9, abs=1e-12), key
    expected, got = weights_at(sync, ASYNC_STEPS), weights_at(run, ASYNC_STEPS)
    assert expected.keys() == got.keys()
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, atol=1e-10, rtol=0, msg=name)


def test_async_rollout_with_two_trainers_trains_on_stale_rounds_within_the_bound(async_runs):
    """max_staleness 2 (a round sampled one round ahead): both processes take the same arrivals,
    so they report the same staleness, and no trained round is staler than the bound. With
    pruning_rate auto both prune at the first process's rate (each waited its own time)."""
    run, _ = async_runs["async2"]
    summaries = [json.loads((run / f"summary-rank{r}.json").read_text()) for r in (0, 1)]
    assert summaries[0]["pruning_rate_last"] == summaries[1]["pruning_rate_last"]
    figures = [s["asynchronous"] for s in summaries]
    assert figures[0] == {**figures[1], "generator_busy": figures[0]["generator_busy"],
                          "trainer_busy": figures[0]["trainer_busy"]}
    assert figures[0]["staleness_max"] == 2 and figures[0]["dropped_stale"] == 0
    assert max(r["sample/staleness_max"] for r in records(run)) <= 2


@pytest.fixture(scope="module")
def fsdp_async_runs(tiny_model_dir, tmp_path_factory):
    """{name: (run dir, torchrun log)} under distributed: fsdp: sync, and async_rollout at
    max_staleness 0 and 1."""
    root = tmp_path_factory.mktemp("fsdp_async")
    out = {}
    for name, extra in (("sync", {}), ("async0", dict(async_rollout=True, max_staleness=0)),
                        ("async1", dict(async_rollout=True, max_staleness=1))):
        _, log = torchrun(async_spec(tiny_model_dir, root / name, distributed="fsdp", **extra),
                          root / f"{name}.json")
        out[name] = (root / name, log)
    return out


def test_async_rollout_with_two_fsdp_trainers_at_max_staleness_0_is_the_synchronous_run(
        fsdp_async_runs):
    """distributed: fsdp, each process holding half of each parameter: every push gathers the
    parameters one by one into the generator's staging copy, so at max_staleness 0 the run has
    the losses and weights (float64 round-off, 1e-10) of the synchronous fsdp run."""
    (sync, _), (run, log) = fsdp_async_runs["sync"], fsdp_async_runs["async0"]
    assert "2 training processes" in log.read_text()
    assert_same_training(sync, run)


def test_async_rollout_with_two_fsdp_trainers_trains_on_stale_rounds(fsdp_async_runs):
    """max_staleness 1 under fsdp: every step is done, with finite losses, and no trained round
    is staler than the bound."""
    run, _ = fsdp_async_runs["async1"]
    rows = records(run)
    assert len(rows) == ASYNC_STEPS // 2
    assert all(math.isfinite(r["loss"]) for r in rows)
    assert max(r["sample/staleness_max"] for r in rows) <= 1
    summary = json.loads((run / "summary-rank0.json").read_text())
    assert summary["asynchronous"]["staleness_max"] <= 1
    assert (run / f"checkpoint-{ASYNC_STEPS}" / "model.safetensors").exists()


def test_sigterm_under_torchrun_stops_trainers_and_generator_then_resume_is_identical(
        async_runs, tiny_model_dir, tmp_path):
    """SIGTERM to the torchrun agent while rank 1 is inside the second round: both processes
    finish the round, save checkpoint-4 and exit 143, the generator process ends with them, and
    --resume replays the third round: the same weights as the uninterrupted run (float64
    round-off)."""
    run = tmp_path / "terminated"
    config = async_spec(tiny_model_dir, run, async_rollout=True, max_staleness=0,
                        park_at_step=[1, 2])
    proc, log = torchrun(config, tmp_path / "sigterm.json", wait=False)
    wait_for(run / "parked-rank1", [proc], [log])
    generator = generator_pid(log)
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=240) != 0, log.read_text()[-3000:]
    assert [int((run / f"exit-rank{r}").read_text()) for r in (0, 1)] == [143, 143]
    assert gone(generator) or "State:\tZ" in Path(f"/proc/{generator}/status").read_text()
    assert ckpt.latest_checkpoint(run) == run / "checkpoint-4"
    config["config"]["resume"], config["park_at_step"] = True, None
    torchrun(config, tmp_path / "resume.json")
    expected, got = weights_at(async_runs["async0"][0], ASYNC_STEPS), weights_at(run, ASYNC_STEPS)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, atol=1e-10, rtol=0, msg=name)


def test_a_killed_generator_under_torchrun_is_an_error_on_every_process(tiny_model_dir, tmp_path):
    """The generator SIGKILLed while rank 0 is inside the second round: rank 0 reports it when it
    next waits for a round, and rank 1, waiting for its part, gets the same error instead of
    hanging in the collective; checkpoint-4 stays."""
    run = tmp_path / "killed"
    config = async_spec(tiny_model_dir, run, async_rollout=True, max_staleness=0,
                        park_at_step=[0, 2], save_steps=1)
    proc, log = torchrun(config, tmp_path / "killed.json", wait=False)
    wait_for(run / "parked-rank0", [proc], [log])
    os.kill(generator_pid(log), signal.SIGKILL)
    (run / "stop-rank0").touch()
    assert proc.wait(timeout=240) != 0
    text = log.read_text()
    assert "GeneratorError: the generator process" in text and "signal 9" in text, text[-3000:]
    assert "GeneratorError: on the first process: the generator process" in text, text[-3000:]
    assert (run / "checkpoint-4" / "COMPLETE").exists()
