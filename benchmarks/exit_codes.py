"""Exit-code soak: launch a 2-process CPPO run under torchrun many times and count how it ends.

    python benchmarks/exit_codes.py                  # 8 launches per variant, 2 busy loops
    python benchmarks/exit_codes.py --launches 4 --load 0

Each launch is `torchrun --nproc_per_node 2` of this file in worker mode: a 4-step CPPO run
(tiny random Llama, gloo, 1 thread per process) that ends as a user's script does, by returning
from `train()` (and, with post-run collectives, a gathered forward afterwards, as the tests do).
Variants: ddp and fsdp, with and without the post-run collectives, each with cppo's teardown
(the process group ended while the interpreter is whole) and without it (the exit handler taken
out: what a run did before the teardown existed). A control runs the same number of launches of
a bare gloo script (all-reduces, then exit) with and without `destroy_process_group`, and of a
gloo script whose group is still held by another object when cppo's exit handler destroys it (as
FSDP's module states hold it), with and without the handler's drain of gloo's worker threads.
`--load N` runs N busy loops meanwhile: the abort at exit shows when the machine is busy.
Two-node variants launch the same run as 2 "nodes" of 1 process each (one torchrun per node,
`--nnodes 2 --nproc_per_node 1`, c10d rendezvous on 127.0.0.1, as tests/test_distributed.py's
`two_nodes`), with cppo's teardown and the drain taken out (`GLOO_DRAIN_S = 0`): the engine's
release of the group alone; each worker also records how many gloo worker threads were still
alive after the group's end (0: the destructor joined them).

Then, `--stop-repeats` times each: seconds from SIGTERM to exit, for `cppo train` (the embedded
default, one process, signalled after its first logged steps) and for the 2-process fsdp run
under torchrun (the agent signalled mid-run; it sends SIGTERM on to both workers): the time a
scheduler's grace period must cover here.

Writes benchmarks/results/exit_codes/results.md and results.json: per variant, the launches,
torchrun's exit codes, the workers that died by SIGABRT ("terminate called without an active
exception") and the median launch time; the SIGTERM-to-exit seconds and exit codes.
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

from common import machine, read_results, spread, write_results

RESULTS = Path(__file__).resolve().parent / "results" / "exit_codes"
ROWS = [{"prompt": f"{a:02d}*{b:02d}=", "answer": f"{a * b:04d}"} for a in range(10) for b in range(3, 9)]
BARE_GLOO = """
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1000)
for _ in range(50):
    dist.all_reduce(t)
out = [None] * dist.get_world_size()
dist.all_gather_object(out, {"rank": dist.get_rank()})
if os.environ.get("DESTROY") == "1":
    dist.destroy_process_group()
"""
HELD_GLOO = """
import os, sys, torch, torch.distributed as dist
from cppo.parallel import processes
if os.environ.get("DRAIN") == "0":   # the drain taken out: what close() did before it existed
    processes.GLOO_DRAIN_S = 0.0
processes.Distributed.from_environment()   # its exit handler destroys the group
HELD = dist.group.WORLD   # held elsewhere, as FSDP's module states hold it
sys.setswitchinterval(1000.0)   # a busy main thread: the worker threads get the lock late
for _ in range(20):   # not waited for: the workers finish them, and free their tensors, at exit
    dist.all_reduce(torch.ones(1000), async_op=True)
"""


def length_reward(prompts, completions, completion_ids=None, **kw):
    return [float(len(c) % 2) + 0.1 * (len(c) % 3) for c in completions]


def worker(spec_path: str) -> int:
    """One process of a launch (under torchrun)."""
    import atexit

    import torch
    from cppo.config import CPPOConfig
    from cppo.trainer import EXIT_CODES, CPPOTrainer
    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    if spec.get("drain", True) is False:   # the release alone: no wait after the group's end
        from cppo.parallel import processes
        processes.GLOO_DRAIN_S = 0.0
    if spec.get("threads_file"):   # registered first, so it runs after the trainer's handler
        atexit.register(record_threads, spec["threads_file"])
    trainer = CPPOTrainer(model=spec["model"], reward_funcs=[length_reward],
                          args=CPPOConfig(**spec["config"]), train_dataset=ROWS)
    if not spec["teardown"]:   # as before the teardown existed: nobody ends the process group
        atexit.unregister(trainer.dist.close)
    summary = trainer.train()
    if spec["post_run"]:
        with trainer.engine.gathered(), torch.no_grad():
            trainer.policy(input_ids=torch.arange(3, 15).view(2, 6))
    return EXIT_CODES[summary["status"]]


def record_threads(path: str) -> None:
    """At exit, after cppo's handler ended the group: the gloo threads still alive."""
    from cppo.parallel.processes import collective_threads
    with open(path, "a") as fh:
        fh.write(f"{collective_threads()}\n")


def tiny_model(path: Path) -> str:
    import torch
    from transformers import LlamaForCausalLM
    from cppo.models.loading import tiny_model_config
    from cppo.models.tokenizer import build_tokenizer
    torch.manual_seed(0)
    tok = build_tokenizer()
    model = LlamaForCausalLM(tiny_model_config(len(tok), bos_token_id=tok.bos_token_id,
                                               eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id, hidden_size=32,
                                               num_layers=2, num_heads=2, intermediate_size=64))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def launch(script: list[str], env: dict, log: Path) -> tuple[int, int, float]:
    """(torchrun's exit code, workers killed by SIGABRT, seconds)."""
    from cppo.parallel.processes import free_port
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_addr", "127.0.0.1", "--master_port", str(free_port())] + script
    began = time.perf_counter()
    with open(log, "w") as fh:
        code = subprocess.call(command, env={**os.environ, "OMP_NUM_THREADS": "1", **env},
                               stdout=fh, stderr=subprocess.STDOUT, timeout=600)
    text = log.read_text()
    return code, text.count("exitcode  : -6"), time.perf_counter() - began


def launch_two_nodes(script: list[str], env: dict, log: Path) -> tuple[int, int, float]:
    """Two torchrun agents of 1 worker each, c10d rendezvous on 127.0.0.1: (the first non-zero
    exit code of the two, or 0; workers killed by SIGABRT; seconds)."""
    from cppo.parallel.processes import free_port
    endpoint = f"127.0.0.1:{free_port()}"
    environ = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    began = time.perf_counter()
    procs, logs = [], []
    for node in (0, 1):
        logs.append(log.with_name(f"{log.stem}-node{node}.log"))
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                   "--nproc_per_node", "1", "--node_rank", str(node), "--rdzv_backend", "c10d",
                   "--rdzv_endpoint", endpoint, "--rdzv_id", "soak"] + script
        procs.append(subprocess.Popen(command, env=environ, stdout=open(logs[-1], "w"),
                                      stderr=subprocess.STDOUT))
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=600))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(proc.wait())
    text = "".join(f"== {path.name}\n{path.read_text()}" for path in logs)
    log.write_text(text)
    return next((c for c in codes if c), 0), text.count("exitcode  : -6"), \
        time.perf_counter() - began


def run_config(root: Path, strategy: str) -> dict:
    """The 2-process CPPO run every cppo variant launches: 4 steps of the tiny model."""
    return dict(output_dir=str(root / "run"), per_device_train_batch_size=2,
                gradient_accumulation_steps=2, num_generations=4, pruning_rate=0.5,
                selection_scope="global", beta=0.04, num_iterations=2, max_steps=4,
                generation_chunk_size=8, max_completion_length=5, learning_rate=1e-3,
                eval_steps=0, save_steps=2, progress_bar=False, seed=3, distributed=strategy)

def variants(model: str, root: Path) -> list[tuple[str, list[str], dict]]:
    out = []
    bare = root / "bare_gloo.py"
    bare.write_text(BARE_GLOO)
    for destroy in (True, False):
        out.append((f"bare gloo script, {'with' if destroy else 'without'} destroy_process_group",
                    [str(bare)], {"DESTROY": "1" if destroy else "0"}))
    held = root / "held_gloo.py"
    held.write_text(HELD_GLOO)
    for drain in (True, False):
        out.append(("gloo script, group held elsewhere, ended by cppo's exit handler"
                    + ("" if drain else ", NO drain (before the fix)"),
                    [str(held)], {"DRAIN": "1" if drain else "0"}))
    for teardown in (True, False):
        for strategy in ("ddp", "fsdp"):
            for post_run in (False, True):
                name = (f"cppo {strategy}, {'with' if post_run else 'no'} post-run collectives, "
                        f"{'teardown' if teardown else 'NO teardown (before the fix)'}")
                config = run_config(root, strategy)
                spec = root / f"spec-{len(out)}.json"
                spec.write_text(json.dumps({"config": config, "model": model, "post_run": post_run,
                                            "teardown": teardown}))
                out.append((name, [__file__, "--worker", str(spec)], {}))
    for strategy in ("fsdp", "ddp"):
        name = (f"cppo {strategy}, two nodes (c10d), with post-run collectives, teardown "
                f"(release), NO drain")
        config = run_config(root, strategy)
        spec = root / f"spec-{len(out)}.json"
        spec.write_text(json.dumps({"config": config, "model": model, "post_run": True,
                                    "teardown": True, "drain": False,
                                    "threads_file": str(root / "threads.txt")}))
        out.append((name, [__file__, "--worker", str(spec)], {"TWO_NODES": "1"}))
    return out


def logged_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    return sum('"reward"' in line for line in path.read_text().splitlines())


def time_to_stop(command: list[str], run_dir: Path, log: Path, after_steps: int) -> dict:
    """Start `command`, send SIGTERM once `after_steps` steps are logged, time the exit."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as fh:
        proc = subprocess.Popen(command, env=env, stdout=fh, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while logged_steps(run_dir) < after_steps:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{command[:4]} ended before the signal:\n{log.read_text()[-2000:]}")
            time.sleep(0.05)
        sent = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=600)
        took = time.perf_counter() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"seconds": took, "exit code": code, "status": summary["status"], "steps": summary["steps"]}


def stop_latency(model: str, root: Path, repeats: int, load: int) -> list[dict]:
    rows = []
    for name in ("cppo train (embedded default, 1 process)",
                 "torchrun, 2 processes, fsdp (SIGTERM to the agent)"):
        runs = []
        for i in range(repeats):
            run_dir = root / f"stop-{len(rows)}-{i}"
            if name.startswith("cppo train"):
                command = [sys.executable, "-m", "cppo.cli", "train", "--output_dir", str(run_dir),
                           "--progress_bar", "false"]
                after = 5
            else:
                from cppo.parallel.processes import free_port
                config = dict(output_dir=str(run_dir), per_device_train_batch_size=2,
                              gradient_accumulation_steps=2, num_generations=4, pruning_rate=0.5,
                              selection_scope="global", beta=0.04, num_iterations=2, max_steps=400,
                              generation_chunk_size=8, max_completion_length=5, learning_rate=1e-3,
                              eval_steps=0, save_steps=0, progress_bar=False, seed=3,
                              distributed="fsdp")
                spec = root / f"stop-spec-{i}.json"
                spec.write_text(json.dumps({"config": config, "model": model, "post_run": False,
                                            "teardown": True}))
                command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
                           __file__, "--worker", str(spec)]
                after = 2
            runs.append(time_to_stop(command, run_dir, root / "stop.log", after))
        seconds = spread([r["seconds"] for r in runs], digits=2)
        row = {"run": name, "repeats": repeats, "busy loops": load,
               "seconds (min-max)": [seconds["min"], seconds["max"]],
               "exit codes": sorted({r["exit code"] for r in runs}),
               "statuses": sorted({r["status"] for r in runs})}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--launches", type=int, default=8, help="launches per variant")
    parser.add_argument("--load", type=int, default=2, help="busy loops running meanwhile")
    parser.add_argument("--only", default="", help="run only variants whose name contains this")
    parser.add_argument("--stop-repeats", type=int, default=3,
                        help="SIGTERM-to-exit measurements per run kind (0: none)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="cppo-exit-codes-") as tmp:
            root = Path(tmp)
            model = tiny_model(root / "model")
            for name, script, env in variants(model, root):
                if args.only not in name or not args.launches:
                    continue
                codes, aborts, seconds = collections.Counter(), 0, []
                threads = root / "threads.txt"
                threads.unlink(missing_ok=True)
                for i in range(args.launches):   # one variant at a time: same load for its runs
                    run = launch_two_nodes if env.get("TWO_NODES") else launch
                    code, aborted, took = run(script, env, root / "launch.log")
                    codes[code] += 1
                    aborts += aborted
                    seconds.append(took)
                    print(f"  {name}: launch {i + 1}: exit {code}, aborted {aborted}, "
                          f"{took:.1f} s", flush=True)
                    if code != 0 and not (root / f"failed-{len(rows)}.log").exists():
                        (root / f"failed-{len(rows)}.log").write_text((root / "launch.log").read_text())
                row = {"variant": name, "launches": args.launches, "busy loops": args.load,
                       "exit codes": dict(sorted(codes.items())), "workers aborted (SIGABRT)": aborts,
                       "launch seconds (median)": spread(seconds, digits=1)["median"]}
                if threads.is_file():   # per worker: gloo threads alive after the group's end
                    left = [int(x) for x in threads.read_text().split()]
                    row["gloo threads left after close (max over workers)"] = max(left)
                    row["workers reporting"] = len(left)
                rows.append(row)
                print(json.dumps(row), flush=True)
            stops = stop_latency(model, root, args.stop_repeats, args.load) if args.stop_repeats else []
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    save(args, rows, stops)
    return 0


def save(args, rows: list[dict], stops: list[dict]) -> None:
    """results.json and results.md; rows of variants and loads (and the SIGTERM table) this
    invocation did not measure (`--only`, `--load`, `--launches 0`, `--stop-repeats 0`) are kept
    from results.json."""
    info = machine(threads_per_process=1, backend="gloo")
    earlier = read_results(args.output)
    for r in earlier.get("rows", []):   # files written before rows carried their own load
        r.setdefault("busy loops", earlier.get("busy_loops"))
    measured = {(r["variant"], r["busy loops"]) for r in rows}   # one row per variant and load
    rows = [r for r in earlier.get("rows", []) if (r["variant"], r["busy loops"]) not in measured] \
        + rows
    stops = stops or earlier.get("sigterm_to_exit", [])
    write_results(args.output, {"machine": info, "rows": rows, "sigterm_to_exit": stops},
                  render(info, rows, stops))


def render(info: dict, rows: list[dict], stops: list[dict]) -> list[str]:
    """results.md's lines."""
    lines = ["# benchmarks/exit_codes.py", "",
             f"Machine: {json.dumps(info)}. Command: `python benchmarks/exit_codes.py --launches "
             f"N --load L` (each row says its N and L: busy loops running during its launches).",
             "", "| variant | launches | busy loops | torchrun exit codes (code: count) | workers "
             "aborted (SIGABRT) | gloo threads left after close | launch s (median) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        codes = ", ".join(f"{k}: {v}" for k, v in r["exit codes"].items())
        left = r.get("gloo threads left after close (max over workers)", "")
        lines.append(f"| {r['variant']} | {r['launches']} | {r.get('busy loops', '')} | {codes} | "
                     f"{r['workers aborted (SIGABRT)']} | {left} | "
                     f"{r['launch seconds (median)']} |")
    lines += ["", "A worker aborted by SIGABRT printed `terminate called without an active "
              "exception` after its run had finished; torchrun then exits 1. The cause: a gloo "
              "process group nobody destroyed lives into interpreter shutdown, and its worker "
              "threads still hold finished collectives whose tensors have Python owners; "
              "releasing one there needs the interpreter, which is going away, and the thread is "
              "ended inside C++ code that cannot be unwound. cppo's trainer ends the group it "
              "started (`CPPOTrainer.close()`, or an exit handler while the interpreter is whole). "
              "Destroying the group does not stop its threads while another object still holds "
              "it: DDP's reducer, FSDP's module states and every DeviceMesh do, and so do the "
              "default arguments of `torch.distributed.nn.functional` when it is imported after "
              "the group started. The engine now releases its references first (`Engine.release`, "
              "called by `Distributed.close()`) and that module is imported before the group "
              "starts, so destroying the group runs its destructor, which joins the threads: the "
              "two-node rows run with the drain taken out and count the gloo threads left after "
              "the end (0). The drain (a wait, with the interpreter's lock released, for the "
              "threads to release their last work) now runs only when a gloo thread outlives "
              "the end, i.e. when an object cppo does not know of holds the group (the 'group "
              "held elsewhere' rows)."]
    if stops:
        lines += ["", "SIGTERM to exit (the step in progress finishes, a checkpoint is written, "
                  "the summary and plots are drawn):", "",
                  "| run | repeats | busy loops | seconds (min-max) | exit codes | status |",
                  "|---|---|---|---|---|---|"]
        for r in stops:
            low, high = r["seconds (min-max)"]
            lines.append(f"| {r['run']} | {r['repeats']} | {r.get('busy loops', '')} | {low}-{high} | "
                         f"{', '.join(map(str, r['exit codes']))} | {', '.join(r['statuses'])} |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
