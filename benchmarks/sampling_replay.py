"""Held-out accuracy, time and the sampler's importance weights of the embedded default with
top_p 0.9, with and without sampling replay (replay_sampling; docs/objectives.md).

Each row is one in-process run of the README's main job (`cppo train`: the shipped tiny model,
the arithmetic task, G = 8, allocation, its dtypes as `auto` picks them on this machine)
changed only by top_p, replay_sampling and seed. Where the sampler runs in another dtype than
the training passes (generation_dtype auto picks bfloat16 on CPUs with fast bf16), its
log-probs are recorded and the importance weights correct for it: the weights' statistics
(sampling/importance_sampling_ratio/*, sampling/sampling_logp_difference/*, over the run's
logged steps) show what the truncation adds to the dtype's mismatch when it is not replayed.

    python benchmarks/sampling_replay.py                        # 2 settings x 3 seeds
    python benchmarks/sampling_replay.py --seeds 42 --max_steps 100   # a quick look

Writes benchmarks/results/sampling_replay/results.json and results.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from common import (accuracy_cells, earlier_rows, machine, main_job_run, sweep_options,
                    write_results)

OUT = Path(__file__).resolve().parent / "results" / "sampling_replay"
SETTINGS = {"replay": True, "full softmax (TRL)": False}


def weight_stats(run_dir: Path) -> dict:
    """The sampler weights' statistics over the run's logged steps ({} when none was logged):
    the mean of each step's mean ratio, the smallest ratio and the largest log-prob difference."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "sampling/importance_sampling_ratio/mean" in r]
    if not rows:
        return {}
    return {"ratio_mean": round(statistics.mean(r["sampling/importance_sampling_ratio/mean"] for r in rows), 4),
            "ratio_min": min(r["sampling/importance_sampling_ratio/min"] for r in rows),
            "logp_difference_max": max(r["sampling/sampling_logp_difference/max"] for r in rows)}


def run_row(name: str, seed: int, args, runs_dir: Path) -> dict:
    """One training run: held-out accuracy before and after, times and the sampler weights."""
    run_dir = runs_dir / f"{name.split()[0]}-s{seed}"
    row, trainer = main_job_run({"setting": name, "seed": seed}, run_dir, top_p=args.top_p,
                                replay_sampling=SETTINGS[name], seed=seed,
                                max_steps=args.max_steps)
    return {**row, "generation_dtype": trainer.generation_dtype, **weight_stats(run_dir)}


def table(rows: list[dict]) -> list[str]:
    """One line per setting: accuracy gain and train seconds, median (min-max) over seeds, and
    the sampler weights over every seed's steps."""
    lines = ["| log-probs of the training passes | seeds | accuracy before -> after (mean) "
             "| gain, points: median (min to max) | train s: median (min-max) "
             "| weight: mean / min | largest log-prob difference |",
             "|---|---|---|---|---|---|---|"]
    for name in SETTINGS:
        runs = [r for r in rows if r["setting"] == name]
        if not runs:
            continue
        weighed = [r for r in runs if "ratio_mean" in r]
        weights = (f"{statistics.mean(r['ratio_mean'] for r in weighed):.4f} / "
                   f"{min(r['ratio_min'] for r in weighed):.3f} | "
                   f"{max(r['logp_difference_max'] for r in weighed):.3f}") if weighed else \
            "not recorded (sampler and training in one dtype) | -"
        lines.append(f"| {name} | {len(runs)} | {accuracy_cells(runs)} | {weights} |")
    return lines


def report(data: dict) -> list[str]:
    m = data["machine"]
    dtypes = sorted({r["generation_dtype"] or "the policy's" for r in data["rows"]})
    return [f"# Sampling replay: top_p {data['top_p']}, replayed or the full softmax", "",
            f"The README's main job (embedded model and task, G = 8, allocation) with top_p "
            f"{data['top_p']}, {data['max_steps']} optimizer steps, the default dtypes (sampling "
            f"in {', '.join(dtypes)}); {m['cpu']}, torch CPU capability {m['cpu_capability']}, "
            f"{m['cores']} cores (`python benchmarks/sampling_replay.py`). Accuracy: greedy, the "
            f"whole held-out split. Train seconds exclude evaluations; this machine's speed "
            f"drifts by 25 % or more (each row records the load average when it started and "
            f"ended). Weight: the importance weight of the sampler's log-probs against the "
            f"training pass's, per token, over all logged steps.", "",
            *table(data["rows"]), ""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--top_p", type=float, default=0.9)
    sweep_options(parser, OUT)
    args = parser.parse_args(argv)
    rows = earlier_rows(args, top_p=args.top_p)
    done = {(r["setting"], r["seed"]) for r in rows}
    runs_dir = Path(tempfile.mkdtemp(prefix="cppo_sampling_replay_"))
    for seed in args.seeds:
        for name in args.settings:
            if (name, seed) in done:
                continue
            print(f"sampling_replay: {name} seed={seed}", file=sys.stderr, flush=True)
            rows.append(run_row(name, seed, args, runs_dir))
            data = {"machine": machine(), "max_steps": args.max_steps, "top_p": args.top_p,
                    "rows": rows}
            write_results(args.out, data, report(data), echo=False)
    data = {"machine": machine(), "max_steps": args.max_steps, "top_p": args.top_p, "rows": rows}
    write_results(args.out, data, report(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
