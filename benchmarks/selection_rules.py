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
import sys
import tempfile
from pathlib import Path

from common import (accuracy_cells, earlier_rows, machine, main_job_run, sweep_options,
                    write_results)

OUT = Path(__file__).resolve().parent / "results" / "selection_rules"
RULES = ("largest_abs", "unbiased")


def run_row(rule: str, pruning_rate: float, seed: int, args, runs_dir: Path) -> dict:
    """One training run; its held-out accuracy before and after and its times."""
    return main_job_run({"rule": rule, "pruning_rate": pruning_rate, "seed": seed},
                        runs_dir / f"{rule}-P{pruning_rate}-s{seed}", selection_rule=rule,
                        pruning_rate=pruning_rate, seed=seed, max_steps=args.max_steps)[0]


def table(rows: list[dict]) -> list[str]:
    """One line per (rule, P): accuracy gain and train seconds, median (min-max) over seeds."""
    lines = ["| rule | P | seeds | accuracy before -> after (mean) | gain, points: median (min to max) "
             "| train s: median (min-max) |", "|---|---|---|---|---|---|"]
    for p in sorted({r["pruning_rate"] for r in rows}):
        for rule in RULES:
            runs = [r for r in rows if r["rule"] == rule and r["pruning_rate"] == p]
            if not runs:
                continue
            lines.append(f"| {rule} | {p} | {len(runs)} | {accuracy_cells(runs)} |")
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
    sweep_options(parser, OUT)
    args = parser.parse_args(argv)
    rows = earlier_rows(args)
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
