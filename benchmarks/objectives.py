"""Held-out accuracy of TRL's GRPO-family objectives on the embedded task, with and without pruning.

Each row is one in-process `CPPOTrainer` run of the embedded recipe (the shipped tiny model, the
arithmetic task, G = 8) for the same number of optimizer steps, changed only by the objective
(docs/objectives.md) and the pruning rate P (0: plain GRPO-style training; 0.75: the default, with
allocation). It records held-out greedy accuracy before and after, the training seconds, and the
CPU capability torch ran with.

    python benchmarks/objectives.py                       # every row, seed 42, 60 steps, mu 2
    python benchmarks/objectives.py --num_iterations 1    # one update per generation round
    python benchmarks/objectives.py --rows dapo,gspo --pruning_rates 0 --max_steps 50 --seeds 1,2
    python benchmarks/objectives.py --seeds 42,1,2 --resume   # add seeds to the results there

Each row records the machine's load average when it started and ended (the machine may be shared).

Writes benchmarks/results/objectives/num_iterations_<mu>/results.md and results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from common import machine, read_results, trainer_for, write_results

OBJECTIVES = {
    "grpo": dict(loss_type="grpo"),
    "dapo": dict(loss_type="dapo"),
    "gspo": dict(loss_type="grpo", importance_sampling_level="sequence"),
    "cispo": dict(loss_type="cispo", epsilon_high=5.0),   # MiniMax-M1 / ScaleRL's epsilon_max
    "sapo": dict(loss_type="sapo"),
}


def run_row(objective: str, pruning_rate: float, seed: int, args, runs_dir: Path) -> dict:
    out = runs_dir / f"{objective}-P{pruning_rate}-s{seed}"
    start, load_start = time.perf_counter(), os.getloadavg()[0]
    trainer = trainer_for(quiet=False, **OBJECTIVES[objective], pruning_rate=pruning_rate,
                          seed=seed, num_iterations=args.num_iterations,
                          max_steps=args.max_steps, eval_steps=0, save_steps=0,
                          eval_num_questions=args.eval_questions, output_dir=str(out),
                          report_to=["jsonl"],
                          generation_dtype=None,   # float32 sampling on every machine ('auto' is by CPU)
                          matmul_dtype=None)       # and float32 training matmuls
    summary = trainer.train()
    return {"objective": objective, "options": OBJECTIVES[objective], "pruning_rate": pruning_rate,
            "seed": seed, "steps": summary["steps"], "accuracy_before": summary["accuracy_before"],
            "accuracy_after": summary["accuracy_after"], "train_seconds": summary["train_seconds"],
            "wall_seconds": round(time.perf_counter() - start, 1),
            "completions_trained": summary.get("completions_trained"),
            "load_average": [round(load_start, 2), round(os.getloadavg()[0], 2)]}


def summary_table(results: list[dict]) -> list[str]:
    """Per objective and P over the seeds run: the mean gain and its range (min to max)."""
    groups: dict[tuple, list[float]] = {}
    for r in results:
        groups.setdefault((r["objective"], r["pruning_rate"]), []).append(
            100 * (r["accuracy_after"] - r["accuracy_before"]))
    if all(len(g) == 1 for g in groups.values()):
        return []
    lines = ["", "Over the seeds:", "", "| objective | P | seeds | mean gain (points) | "
             "range (points) |", "|---|---|---|---|---|"]
    for (objective, rate), gains in groups.items():
        lines.append(f"| {objective} | {rate} | {len(gains)} | {sum(gains) / len(gains):+.1f} | "
                     f"{min(gains):+.1f} to {max(gains):+.1f} |")
    return lines


def render(results: list[dict], meta: dict) -> str:
    lines = ["# Objectives x pruning on the embedded task", "",
             f"Command: `{meta['command']}`", "",
             f"Machine: {meta['machine']}", "",
             f"Each row: the embedded recipe (shipped tiny model, arithmetic level 3, G = 8, "
             f"lr 1.6e-4 cosine, num_iterations {meta.get('num_iterations', 1)}) for "
             f"{meta['max_steps']} optimizer steps, then held-out greedy "
             f"accuracy on {meta['eval_questions']} test questions; seeds {meta['seeds']}. "
             f"Objectives as in docs/objectives.md (cispo with epsilon_high 5.0). With P = 0.75 "
             f"each step samples 4x the questions and trains on the kept quarter (allocation), "
             f"so a row with pruning sees more questions in the same number of steps.", "",
             "| objective | P | seed | accuracy before | accuracy after | gain (points) | "
             "train s | load average (1 min) at start, end |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        gain = 100 * (r["accuracy_after"] - r["accuracy_before"])
        load = r.get("load_average")
        load = f"{load[0]:.1f}, {load[1]:.1f}" if load else "not recorded"
        lines.append(f"| {r['objective']} | {r['pruning_rate']} | {r['seed']} | "
                     f"{100 * r['accuracy_before']:.1f}% | {100 * r['accuracy_after']:.1f}% | "
                     f"{gain:+.1f} | {r['train_seconds']:.0f} | {load} |")
    lines += summary_table(results)
    lines += ["", f"Total wall time: {meta['wall_seconds']:.0f} s (a shared machine: train seconds "
              f"are not comparable between rows). Differences of a few points are within "
              f"seed-to-seed spread: compare the ranges over seeds, not single rows.",
              "", "With one update per generation round (num_iterations 1) every ratio is 1 and "
              "the objectives' gradients coincide up to how they weight completions of different "
              "lengths (cispo's is dapo's, sapo's is grpo's, GSPO's is grpo's); on this task most "
              "answers have the same length, so those rows can coincide. With num_iterations 2 "
              "the second update of each round sees ratios != 1, where they differ."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=",".join(OBJECTIVES))
    parser.add_argument("--pruning_rates", default="0,0.75")
    parser.add_argument("--seeds", default="42")
    parser.add_argument("--max_steps", type=int, default=60)
    parser.add_argument("--num_iterations", type=int, default=2)
    parser.add_argument("--eval_questions", type=int, default=300)
    parser.add_argument("--output", help="results folder (default: results/objectives/"
                        "num_iterations_<mu>)")
    parser.add_argument("--from_json", help="only re-render results.md from this results.json")
    parser.add_argument("--resume", action="store_true", help="keep the rows of the output's "
                        "results.json (same steps, questions, num_iterations) and run the others")
    args = parser.parse_args(argv)
    args.output = args.output or str(Path(__file__).parent / "results" / "objectives"
                                      / f"num_iterations_{args.num_iterations}")
    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
        write_results(args.output, None, render(data["runs"], data["meta"]), echo=False)
        return 0
    torch.set_num_threads(1)   # deterministic for a seed; the shared 2-core machine spins with 2
    rows = args.rows.split(",")
    rates = [float(p) for p in args.pruning_rates.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    out = Path(args.output)
    meta = {"command": "python benchmarks/objectives.py " + " ".join(argv or sys.argv[1:]),
            "machine": machine(), "max_steps": args.max_steps,
            "eval_questions": args.eval_questions, "seeds": seeds,
            "num_iterations": args.num_iterations}
    results, start, earlier = [], time.perf_counter(), 0.0
    old = read_results(out) if args.resume else {}
    if old:
        same = ("max_steps", "eval_questions", "num_iterations")
        if any(old["meta"].get(k, 1 if k == "num_iterations" else None) != meta[k] for k in same):
            raise SystemExit(f"--resume: {out}/results.json was run with other {', '.join(same)}")
        results, earlier = old["runs"], old["meta"].get("wall_seconds", 0.0)
        meta["command"] = old["meta"]["command"] + " && " + meta["command"]
    done = {(r["objective"], r["pruning_rate"], r["seed"]) for r in results}
    meta["seeds"] = sorted({r["seed"] for r in results} | set(seeds))
    with tempfile.TemporaryDirectory() as runs:
        for seed in seeds:
            for objective in rows:
                for rate in rates:
                    if (objective, rate, seed) in done:
                        continue
                    results.append(run_row(objective, rate, seed, args, Path(runs)))
                    meta["wall_seconds"] = earlier + time.perf_counter() - start
                    write_results(out, {"meta": meta, "runs": results}, render(results, meta),
                                  echo=False)
                    print(render(results, meta).splitlines()[-3], flush=True)
    print(render(results, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
