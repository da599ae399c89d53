"""In-place restart soak: `torchrun --max-restarts 1` of a 2-process fsdp CPPO run (gloo), rank 1
SIGKILLed inside step 3, many times, for the static rendezvous (`--master_addr/--master_port`)
and for c10d (`--rdzv_backend c10d`), and how each launch ends.

    python benchmarks/restarts.py                      # 20 launches per rendezvous
    python benchmarks/restarts.py --launches 2 --before 2

Each launch is tests/test_distributed.py's `test_a_restart_by_torchrun_resumes_and_ends_identical`
(tests/helpers/dist_worker.py under torchrun, 4 steps, checkpoints every 2): rank 1 parks in its
reward call of step 3, is SIGKILLed, torchrun stops rank 0 and starts both again in place; they
must resume from checkpoint-2 by themselves and end with the logged steps and bit-identical final
weights of one uninterrupted launch (run first). A launch still running `--bound` seconds after
the kill counts as hung and is killed. `--before N` also runs N launches per rendezvous with the
group started as before cppo.parallel.processes.start_group (a plain init_process_group, whose
keys at torchrun's store are the same in every start).

Writes benchmarks/results/restarts/results.md and results.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT / "tests")]
from common import machine, read_results, spread, write_results  # noqa: E402
from exit_codes import tiny_model  # noqa: E402
from helpers import ROWS  # noqa: E402

RESULTS = HERE / "results" / "restarts"
WORKER = ROOT / "tests" / "helpers" / "dist_worker.py"
STEPS = 4


def spec(model: str, out: Path, **extra) -> dict:
    config = dict(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                  num_generations=4, pruning_rate=0.5, selection_scope="global",
                  scale_rewards="batch", beta=0.04, num_iterations=2, max_steps=STEPS,
                  generation_chunk_size=8, max_completion_length=5, learning_rate=1e-3,
                  eval_steps=0, save_steps=2, progress_bar=False, seed=3, distributed="fsdp")
    return {"config": config, "rows": ROWS, "model": model, **extra}


def torchrun(spec_dict: dict, path: Path, rendezvous: str, restarts: int) -> tuple:
    from cppo.parallel.processes import free_port
    path.write_text(json.dumps(spec_dict))
    launcher = ["--nproc_per_node", "2", "--nnodes", "1", "--max-restarts", str(restarts)]
    if rendezvous == "c10d":
        launcher += ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{free_port()}"]
    else:
        launcher += ["--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "120"}
    env.pop("WORLD_SIZE", None)
    log = path.with_suffix(".log")
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *launcher, str(WORKER),
                             str(path)], env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    return proc, log


def kill_all(proc) -> None:
    """The agent's session and the workers (in sessions of their own)."""
    for child in Path("/proc").glob("[0-9]*"):
        try:
            stat = (child / "stat").read_text().rsplit(")", 1)[1].split()
            if int(stat[1]) == proc.pid:
                os.kill(int(child.name), signal.SIGKILL)
        except (OSError, ValueError, IndexError):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    proc.wait()


def outcome(run: Path, reference: Path) -> str:
    from safetensors.torch import load_file

    def records(d):
        return [(r["step"], r["loss"], r["grad_norm"]) for r in
                map(json.loads, (d / "metrics.jsonl").read_text().splitlines()) if "reward" in r]
    summary = json.loads((run / "summary.json").read_text())
    if not str(summary.get("resumed_from")).endswith("checkpoint-2"):
        return f"completed without resuming from checkpoint-2 ({summary.get('resumed_from')})"
    got = load_file(run / f"checkpoint-{STEPS}" / "model.safetensors")
    want = load_file(reference / f"checkpoint-{STEPS}" / "model.safetensors")
    same = sorted(got) == sorted(want) and all((got[k] == want[k]).all() for k in want)
    if not same or records(run) != records(reference):
        return "resumed, but differs from the uninterrupted run"
    return "resumed, bit-identical"


def one_launch(model: str, root: Path, name: str, rendezvous: str, reference: Path,
               plain: bool, bound: float) -> tuple[str, float]:
    run = root / name
    proc, log = torchrun(spec(model, run, park_at_step=[1, 2], plain_init=plain),
                         root / f"{name}.json", rendezvous, 1)
    deadline = time.monotonic() + 300
    try:
        while not (run / "parked-rank1").exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                return f"ended before the kill (exit {proc.poll()})", 0.0
            time.sleep(0.1)
        os.kill(int((run / "pid-rank1").read_text()), signal.SIGKILL)
        killed = time.monotonic()
        try:
            code = proc.wait(timeout=bound)
        except subprocess.TimeoutExpired:
            return f"hung (> {bound:g} s after the kill)", bound
        took = time.monotonic() - killed
        text = log.read_text()
        if code != 0:
            why = ("connection refused" if "onnection refused" in text else
                   "rendezvous timeout" if "RendezvousTimeout" in text else "other")
            (root / f"failed-{name}.log").write_text(text)
            return f"failed, exit {code} ({why})", took
        if "restart 1 by the launcher: resuming" not in text:
            return "exit 0 without a restart", took
        return outcome(run, reference), took
    finally:
        if proc.poll() is None:
            kill_all(proc)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--launches", type=int, default=20, help="launches per rendezvous")
    parser.add_argument("--before", type=int, default=0,
                        help="launches per rendezvous with the group started as before the fix")
    parser.add_argument("--rendezvous", nargs="+", default=["static", "c10d"])
    parser.add_argument("--bound", type=float, default=240.0,
                        help="seconds after the kill before a launch counts as hung")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="cppo-restarts-") as tmp:
        root = Path(tmp)
        model = tiny_model(root / "model")
        reference = root / "reference"
        proc, log = torchrun(spec(model, reference), root / "reference.json", "static", 0)
        assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
        plan = [(r, False, args.launches) for r in args.rendezvous] + \
            [(r, True, args.before) for r in args.rendezvous]
        for rendezvous, plain, launches in plan:
            if not launches:
                continue
            label = f"{rendezvous}, " + ("plain init_process_group (before the fix)" if plain
                                         else "cppo's start_group")
            ends, seconds = collections.Counter(), []
            for i in range(launches):
                end, took = one_launch(model, root, f"{rendezvous}-{int(plain)}-{i}", rendezvous,
                                       reference, plain, args.bound)
                ends[end] += 1
                seconds.append(took)
                print(f"  {label}: launch {i + 1}: {end} ({took:.1f} s after the kill)", flush=True)
            seconds = spread(seconds, digits=1)
            rows.append({"rendezvous": label, "launches": launches, "ends": dict(ends),
                         "seconds after the kill (min-max)": [seconds["min"], seconds["max"]]})
            print(json.dumps(rows[-1]), flush=True)
    save(args, rows)
    return 0


def save(args, rows: list[dict]) -> None:
    """results.json and results.md; rows of the rendezvous this invocation did not run are kept
    from results.json."""
    info = machine(threads_per_process=1, backend="gloo")
    measured = {r["rendezvous"] for r in rows}
    rows = [r for r in read_results(args.output).get("rows", []) if r["rendezvous"] not in measured] \
        + rows
    write_results(args.output, {"machine": info, "rows": rows}, render(info, rows))


def render(info: dict, rows: list[dict]) -> list[str]:
    """results.md's lines."""
    lines = ["# benchmarks/restarts.py", "",
             f"Machine: {json.dumps(info)}. Command: `python benchmarks/restarts.py --launches N "
             f"--before M` (no busy loops). Each launch: `torchrun --nproc_per_node 2 "
             f"--max-restarts 1`, 2-process fsdp run of {STEPS} steps, rank 1 SIGKILLed inside "
             f"step 3; 'resumed, bit-identical': exit 0 after one restart that resumed from "
             f"checkpoint-2, same logged steps and final weights as an uninterrupted launch.", "",
             "| rendezvous, group start | launches | ends (count) | s from the kill to the end "
             "(min-max) |", "|---|---|---|---|"]
    for r in rows:
        ends = "; ".join(f"{k}: {v}" for k, v in r["ends"].items())
        low, high = r["seconds after the kill (min-max)"]
        lines.append(f"| {r['rendezvous']} | {r['launches']} | {ends} | {low}-{high} |")
    lines += ["", "Why a plain start failed: torchrun keeps one store for all restarts of a worker "
              "group (the static rendezvous's TCPStore, or the c10d rendezvous's shared one, at "
              "the same MASTER_PORT), and init_process_group writes its keys under the same "
              "names (`default_pg/...`) in every start. The restarted group's gloo full-mesh "
              "connect can read the killed group's addresses before the new processes overwrite "
              "them: it dials dead processes (`connectFullMesh`: connection refused) or waits for "
              "a peer that will not answer (a hang until gloo's 30-minute timeout). cppo's "
              "start_group counts each rank's starts at the store and keeps the keys of start n "
              "under `cppo/start<n>/`, after a bounded rendezvous (CPPO_RENDEZVOUS_TIMEOUT)."]
    return lines


if __name__ == "__main__":
    sys.exit(main())
