"""Held-out accuracy and time of CPPO's selection rules on the embedded default: `largest_abs`
(the paper's, biased) against `unbiased` (inclusion probabilities from |A|, Horvitz-Thompson
weights; docs/objectives.md), at pruning rates P = 0.75 and 0.875, over seeds.

Each row is one in-process run of the README's main job (`cppo train`: the shipped tiny model,
the arithmetic task, G = 8, allocation, its dtypes as `auto` picks them on this machine)
changed only by selection_rule, pruning_rate and seed.

    python benchmarks/selection_rules.py                          # 2 rules x 2 rates x 3 seeds
    python benchmarks/selection_rules.py --seeds 42 --max_steps 100   # a quick look
    python benchmarks/selection_rules.py --seeds 3 4 --resume     # add seeds to the results there

Writes benchmarks/results/selection_rules/results.json and results.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import machine, read_results, spread, trainer_for, write_results

OUT = Path(__file__).resolve().parent / "results" / "selection_rules"
RULES = ("largest_abs", "unbiased")


def run_row(rule: str, pruning_rate: float, seed: int, args, runs_dir: Path) -> dict:
    """One training run; its held-out accuracy before and after and its times."""
    start, load_start = time.perf_counter(), os.getloadavg()[0]
    trainer = trainer_for(selection_rule=rule, pruning_rate=pruning_rate, seed=seed,
                          max_steps=args.max_steps, eval_steps=0, save_steps=0,
                          output_dir=str(runs_dir / f"{rule}-P{pruning_rate}-s{seed}"),
                          report_to=["jsonl"])
    summary = trainer.train()
    return {"rule": rule, "pruning_rate": pruning_rate, "seed": seed, "steps": summary["steps"],
            "accuracy_before": summary["accuracy_before"],
            "accuracy_after": summary["accuracy_after"],
            "train_seconds": summary["train_seconds"],
            "wall_seconds": round(time.perf_counter() - start, 1),
            "load_average": [round(load_start, 2), round(os.getloadavg()[0], 2)]}


def table(rows: list[dict]) -> list[str]:
    """One line per (rule, P): accuracy gain and train seconds, median (min-max) over seeds."""
    lines = ["| rule | P | seeds | accuracy before -> after (mean) | gain, points: median (min to max) "
             "| train s: median (min-max) |", "|---|---|---|---|---|---|"]
    for p in sorted({r["pruning_rate"] for r in rows}):
        for rule in RULES:
            runs = [r for r in rows if r["rule"] == rule and r["pruning_rate"] == p]
            if not runs:
                continue
            gain = spread([100 * (r["accuracy_after"] - r["accuracy_before"]) for r in runs], digits=1)
            secs = spread([r["train_seconds"] for r in runs], digits=0)
            before = statistics.mean(r["accuracy_before"] for r in runs)
            after = statistics.mean(r["accuracy_after"] for r in runs)
            lines.append(f"| {rule} | {p} | {len(runs)} | {100 * before:.1f} % -> {100 * after:.1f} % "
                         f"| {gain['median']:+.1f} ({gain['min']:+.1f} to {gain['max']:+.1f}) "
                         f"| {secs['median']:.0f} ({secs['min']:.0f}-{secs['max']:.0f}) |")
    return lines


def report(data: dict) -> list[str]:
    m = data["machine"]
    return ["# Selection rules: largest |A| (CPPO) against the unbiased rule", "",
            f"The README's main job (embedded model and task, G = 8, allocation), "
            f"{data['max_steps']} optimizer steps, the default dtypes; {m['cpu']}, torch CPU capability "
            f"{m['cpu_capability']}, {m['cores']} cores (`python benchmarks/selection_rules.py`). "
            f"Accuracy: greedy, the whole held-out split. Train seconds exclude evaluations; "
            f"this machine's speed drifts by 25 % or more (each row records the load average "
            f"when it started and ended).", "",
            *table(data["rows"]), ""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rules", nargs="+", default=list(RULES), choices=RULES)
    parser.add_argument("--pruning_rates", nargs="+", type=float, default=[0.75, 0.875])
    parser.add_argument("--seeds", nargs="+", type=int, default=[42, 1, 2])
    parser.add_argument("--max_steps", type=int, default=600, help="optimizer steps (600: the default run)")
    parser.add_argument("--resume", action="store_true", help="keep the rows already in the results")
    parser.add_argument("--out", default=str(OUT), help="where results.json and results.md go")
    args = parser.parse_args(argv)
    old = read_results(args.out) if args.resume else {}
    rows = [r for r in old.get("rows", []) if old.get("max_steps") == args.max_steps]
    done = {(r["rule"], r["pruning_rate"], r["seed"]) for r in rows}
    runs_dir = Path(tempfile.mkdtemp(prefix="cppo_selection_rules_"))
    for seed in args.seeds:
        for p in args.pruning_rates:
            for rule in args.rules:
                if (rule, p, seed) in done:
                    continue
                print(f"selection_rules: {rule} P={p} seed={seed}", file=sys.stderr, flush=True)
                rows.append(run_row(rule, p, seed, args, runs_dir))
                data = {"machine": machine(), "max_steps": args.max_steps, "rows": rows}
                write_results(args.out, data, report(data), echo=False)
    data = {"machine": machine(), "max_steps": args.max_steps, "rows": rows}
    write_results(args.out, data, report(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
