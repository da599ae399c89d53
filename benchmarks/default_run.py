"""The default-run table: `cppo train` as a new user runs it, over seeds, with the GRPO rows.

Each row is a fresh `cppo train` process (start-up included in the wall time), with the row's
extra flags and the chosen seed, thread count and CPU limit; the table reports held-out greedy
accuracy before and after, the gain, wall time and the phase times from the run's summary.json.
Rows run one at a time unless --parallel says otherwise (several at a time is fine for accuracy,
which is deterministic for a seed and thread count, but their wall times then measure a loaded
machine; the results say so).

    python benchmarks/default_run.py                          # 3 seeds of the default + GRPO rows
    python benchmarks/default_run.py --emulate-avx2           # the same with torch held to AVX2
    python benchmarks/default_run.py --seeds 42 --rows default --threads 1
    python benchmarks/default_run.py --collect DIR ...        # tabulate finished run directories
    python benchmarks/default_run.py --against /tmp/before    # also a checkout at another revision

Writes benchmarks/results/default_run/results.md and results.json (with the CPU capability the
runs saw, thread count, load average and whether the machine was shared).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from common import machine, trainer_for, write_results

ROWS = {
    "default": [],
    "grpo": ["--pruning_rate", "0"],
    "grpo_same_time": ["--pruning_rate", "0", "--max_steps", "1000"],
    "vllm": ["--use_vllm", "true", "--vllm_enable_sleep_mode", "false"],   # vLLM generating
    "skip": ["--skip_zero_variance_prompts", "true"],
    "speculative": ["--num_speculative_tokens", "4"],
    "bf16_sampling": ["--generation_dtype", "bfloat16"],   # sample from a bf16 copy, IS-corrected
    "float32_sampling": ["--generation_dtype", "none"],   # the policy's own float32 on every CPU
    "float32_matmuls": ["--matmul_dtype", "none"],   # training matmuls in float32 on every CPU
    "float32": ["--generation_dtype", "none", "--matmul_dtype", "none"],   # float32 throughout
    "two_stage": ["--two_stage_generations", "4"],   # 4 of 8 first; the rest only where rewards differ
}
RECIPE_KEYS = ("pruning_rate", "num_generations", "per_device_train_batch_size", "max_steps",
               "max_completion_length", "learning_rate", "lr_scheduler_type")
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def run_env(threads: int, emulate_avx2: bool) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    return {**env, **AVX2_ENV} if emulate_avx2 else env


def start_run(label: str, seed: int, extra: list[str], out_dir: Path, env: dict, tree: str = ""):
    """tree: another checkout of cppo whose src/ the run imports instead (its rev in the label)."""
    cmd = ["cppo", "train", "--seed", str(seed), "--output_dir", str(out_dir),
           "--progress_bar", "false", *extra]
    if tree:
        env = {**env, "PYTHONPATH": str(Path(tree) / "src")}
    log = open(out_dir.with_suffix(".log"), "w")
    rev = f" (tree at {tree_revision(tree)})" if tree else ""
    return {"label": label, "seed": seed, "command": " ".join(["cppo", "train", *extra] +
                                                             (["--seed", str(seed)] if seed != 42 else [])) + rev,
            "out_dir": out_dir, "start": time.perf_counter(), "load_start": os.getloadavg()[0],
            "proc": subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), "log": log}


def tree_revision(tree: str) -> str:
    out = subprocess.run(["git", "-C", tree, "log", "-1", "--format=%h, %cs"], capture_output=True,
                         text=True)
    return out.stdout.strip() or tree


def finish_run(run: dict) -> dict:
    rc = run["proc"].wait()
    run["log"].close()
    wall = time.perf_counter() - run["start"]
    if rc != 0:
        raise SystemExit(f"{run['command']} failed (exit {rc}); see {run['out_dir'].with_suffix('.log')}")
    row = row_from_summary(run["out_dir"], run["label"], run["seed"], run["command"])
    row.update(process_seconds=round(wall, 1),
               load_average=round((run["load_start"] + os.getloadavg()[0]) / 2, 2))
    return row


def row_from_summary(out_dir: Path, label: str, seed: int | None, command: str) -> dict:
    summary = json.loads((Path(out_dir) / "summary.json").read_text())
    config = yaml.safe_load((Path(out_dir) / "config.yaml").read_text())
    if seed is None:
        seed = config["seed"]
        command = f"{command} (seed {seed})"
    phases = summary["phase_seconds_this_session"]
    return {"label": label, "seed": seed, "command": command,
            "accuracy_before": summary["accuracy_before"], "accuracy_after": summary["accuracy_after"],
            "gain_points": round(100 * (summary["accuracy_after"] - summary["accuracy_before"]), 1),
            "steps": summary["steps"], "wall_seconds": summary["wall_seconds"],
            "train_seconds": summary["train_seconds"],
            **{f"{k}_seconds": phases.get(k, 0.0) for k in ("generate", "score", "update", "eval")},
            **{k: config[k] for k in RECIPE_KEYS}}


def run_rows(plan: list[tuple], env: dict, parallel: int, workdir: Path) -> list[dict]:
    """plan: (label, seed, extra flags[, tree]) per run."""
    rows, running = [], []
    for i, (label, seed, extra, *tree) in enumerate(plan):
        while len(running) >= parallel:
            rows.append(finish_run(running.pop(0)))
        out = workdir / f"{i:02d}_{label}_seed{seed}"
        running.append(start_run(label, seed, extra, out, env, *tree))
        print(f"started: {running[-1]['command']}", flush=True)
    rows += [finish_run(r) for r in running]
    return rows


def pct(v: float) -> str:
    return f"{100 * v:.1f} %"


def render(rows: list[dict], meta: dict) -> list[str]:
    """results.md's lines."""
    m = meta["machine"]
    lines = [f"# The default run (`python benchmarks/default_run.py {meta['argv']}`)", "",
             f"CPU: {m['cpu']} ({m['machine']}), torch {m['torch']}, CPU capability the runs saw: "
             f"**{m['cpu_capability']}**{' (emulated: ' + meta['emulation'] + ')' if meta['emulation'] else ''}, "
             f"AVX512-BF16 in the CPU flags: {m['avx512_bf16']}, fast bf16 as torch runs here: "
             f"{m['fast_bfloat16']}; {meta['threads']} thread(s) per run, {meta['parallel']} run(s) "
             f"at a time; machine shared with other work: {meta['shared']} (mean 1-minute load "
             f"average over the runs: {meta['mean_load_average']}).", ""]
    if meta["shared"] or meta["parallel"] > 1:
        lines += ["Wall times measured on a loaded machine are upper bounds for an idle one; the "
                  "accuracies do not depend on the load (deterministic for a seed and thread count).", ""]
    lines += ["| command | steps | before | after | gain | wall s (process) | train s | generate s | "
              "update s | score s | eval s | load avg |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| `{r['command']}` | {r['steps']} | {pct(r['accuracy_before'])} | "
                     f"{pct(r['accuracy_after'])} | {r['gain_points']:+.1f} | "
                     f"{r.get('process_seconds', r['wall_seconds'])} | {r['train_seconds']} | "
                     f"{r['generate_seconds']} | {r['update_seconds']} | {r['score_seconds']} | "
                     f"{r['eval_seconds']} | {r.get('load_average', 'n/a')} |")
    lines.append("")
    for label in dict.fromkeys(r["label"] for r in rows):
        group = [r for r in rows if r["label"] == label]
        gains = [r["gain_points"] for r in group]
        walls = [r.get("process_seconds", r["wall_seconds"]) for r in group]
        lines.append(f"- {label}: {len(group)} run(s), gain mean {statistics.mean(gains):+.1f} "
                     f"(range {min(gains):+.1f} to {max(gains):+.1f}); wall {min(walls):.0f}-{max(walls):.0f} s")
    if meta.get("note"):
        lines += ["", meta["note"]]
    return lines


def flag_pairs(flags: list[str]) -> dict[str, str]:
    """['--key', 'value', ...] -> {'key': 'value', ...} (values parsed by the config)."""
    return {k.lstrip("-"): v for k, v in zip(flags[::2], flags[1::2])}


def step_cost(recipes: dict[str, list[str]], rounds: int, threads: int) -> dict:
    """Seconds per training round (generate, score, update) of each recipe, measured in one
    process with the rounds interleaved (A, B, A, B, ...) so that both see the same load.
    A recipe named 'untrimmed ...' runs with the kept-batch trimming switched off (the code path
    before trimming existed)."""
    import torch
    from cppo.run.batch import StepBatch
    torch.set_num_threads(threads)
    trimmed = StepBatch.trimmed
    trainers = {name: trainer_for(quiet=False, prefix="cppo_cost_", **flag_pairs(flags))
                for name, flags in recipes.items()}
    times = {name: [] for name in recipes}
    for i in range(rounds + 1):                       # round 0 warms up
        for name, trainer in trainers.items():
            StepBatch.trimmed = (lambda self: self) if name.startswith("untrimmed") else trimmed
            start = time.perf_counter()
            trainer.training_round()
            took = time.perf_counter() - start
            phases = trainer.timer.pop_last()
            if i:
                times[name].append({"round": took, **phases})
    StepBatch.trimmed = trimmed
    out = {}
    for name, records in times.items():
        keys = records[0].keys()
        out[name] = {k: round(statistics.median(r.get(k, 0.0) for r in records), 4) for k in keys}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 1, 2])
    parser.add_argument("--rows", nargs="+", default=["default", "grpo"], choices=sorted(ROWS),
                        help="default: the 3 seeds; grpo / grpo_same_time: seed 42 only")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--every-seed", action="store_true",
                        help="run every row with every seed (default: rows other than default with seed 42)")
    parser.add_argument("--parallel", type=int, default=1, help="runs at a time")
    parser.add_argument("--emulate-avx2", action="store_true",
                        help="hold torch's kernels and oneDNN to AVX2 (an AVX2-only CPU's code paths)")
    parser.add_argument("--shared", action="store_true", help="record that other work shared the machine")
    parser.add_argument("--extra", default="", help="more `cppo train` flags for every row")
    parser.add_argument("--collect", nargs="+", metavar="LABEL=DIR",
                        help="tabulate finished runs (summary.json) instead of running")
    parser.add_argument("--step-cost", type=int, metavar="ROUNDS",
                        help="instead of full runs: seconds per training round of the previous "
                             "recipe (untrimmed, 8 tokens) against this default, interleaved in one "
                             "process, ROUNDS rounds each; written to step_cost[_avx2].json")
    parser.add_argument("--against", metavar="DIR", default="",
                        help="also run the default with every seed on another checkout of cppo "
                             "(e.g. `git worktree add /tmp/before REV`; its src/ is imported "
                             "instead of this tree's): row 'against'")
    parser.add_argument("--note", default="", help="a paragraph added to results.md")
    parser.add_argument("--output", default="benchmarks/results/default_run")
    args = parser.parse_args()
    env = run_env(args.threads, args.emulate_avx2)
    if args.step_cost:
        os.environ.update({k: v for k, v in env.items() if k in AVX2_ENV or k.endswith("_THREADS")})
        recipes = {"untrimmed, max_completion_length 8 (before)": ["--max_completion_length", "8"],
                   "default (trimmed)": []}
        cost = step_cost(recipes, args.step_cost, args.threads)
        meta = {"machine": machine(env=env), "threads": args.threads, "shared": args.shared,
                "rounds": args.step_cost, "load_average": os.getloadavg()[0],
                "emulation": ", ".join(f"{k}={v}" for k, v in AVX2_ENV.items()) if args.emulate_avx2 else ""}
        name = "step_cost_avx2.json" if args.emulate_avx2 else "step_cost.json"
        write_results(args.output, {"meta": meta, "median_seconds": cost}, None, json_name=name)
        print(json.dumps(cost, indent=2))
        before, after = cost.values()
        print(f"round time ratio (default / before): {after['round'] / before['round']:.3f}")
        return
    extra = shlex.split(args.extra)
    if args.collect:
        rows = []
        for item in args.collect:
            label, _, path = item.partition("=")
            rows.append(row_from_summary(Path(path), label, None, label))
        loads = []
    else:
        plan = [("default", s, extra) for s in args.seeds if "default" in args.rows]
        other_seeds = args.seeds if args.every_seed else [42]
        plan += [(label, s, ROWS[label] + extra) for label in args.rows if label != "default"
                 for s in other_seeds]
        plan += [("against", s, extra, args.against) for s in args.seeds if args.against]
        with tempfile.TemporaryDirectory(prefix="cppo_default_run_") as tmp:
            rows = run_rows(plan, env, args.parallel, Path(tmp))
        loads = [r["load_average"] for r in rows]
    meta = {"argv": " ".join(sys.argv[1:]), "machine": machine(env=env), "threads": args.threads,
            "parallel": args.parallel, "shared": args.shared,
            "emulation": ", ".join(f"{k}={v}" for k, v in AVX2_ENV.items()) if args.emulate_avx2 else "",
            "mean_load_average": round(statistics.mean(loads), 2) if loads else "n/a",
            "nproc": os.cpu_count(), "note": args.note}
    write_results(args.output, {"meta": meta, "rows": rows}, render(rows, meta))


if __name__ == "__main__":
    main()
