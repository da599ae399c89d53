"""The CPPO paper table on the embedded task, measured honestly (also `cppo bench`).

    python benchmarks/cppo_table.py            # the full table: 3 seeds, every row (8-11 min on a 2-core CPU)
    python benchmarks/cppo_table.py --quick    # smoke run: tiny N, 1 seed, 3 rows + TRL (~1-2 min)

Every training run is one pass over the same N training questions (num_train_questions=N,
num_train_epochs=1, max_steps=-1) with the same hyper-parameters; only the row's knobs differ:

  grpo          the paper's GRPO baseline: B = G = 16 completions per update, 1 question per step
  cppo-P        CPPO with dynamic completion allocation: Q = 1/(1-P) questions per step, G = 16
                completions each, the 16 with the largest |A| over the step are trained on
  fair-P        a fair GRPO baseline for cppo-P: the same Q questions per step, no pruning, all
                16 Q completions in one update
  smallest-0.875, random-0.875, maxvar-0.875
                ablations of the selection rule at P = 0.875 (keep the smallest |A|; keep a random
                16; PODS max reward variance per question, 2 of 16 kept per question)
  unbiased-0.75, unbiased-0.875
                CPPO with selection_rule unbiased: as many kept, drawn with probabilities from
                |A| and weighted by 1 / probability (docs/objectives.md)
  trl           seconds per GRPO step and tokens/s, TRL's GRPOTrainer against ours, B = G = 16

Outputs (in --output, default benchmarks/results/cppo_table): results.md (tables, targets,
formulas, the command and the machine), results.json (every run's summary), accuracy_vs_time.png,
speedup.png. docs/benchmarks.md explains the columns.

This file parses the command line and runs the rows in order; the parts live in
benchmarks/paper_table/: rows (the table's lines and settings), runs (one training run, the time
probe), trl_compare (TRL against ours), stats (bounds, time-to-accuracy, per-row statistics),
formatting, report (results.md/json) and plots.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))   # benchmarks/paper_table, when run as a file
from common import machine_of, write_results  # noqa: E402
from paper_table.formatting import fmt_pm, markdown_table  # noqa: E402
from paper_table.plots import write_plots  # noqa: E402
from paper_table.report import build_report, machine, write_outputs  # noqa: E402
from paper_table.rows import (DEFAULTS, GROUP_SIZE, PRUNING_RATES, QUICK, TIME_BUDGET_SECONDS,  # noqa: E402
                              UPDATE_BATCH, all_rows, questions_per_step)
from paper_table.runs import fitting_questions, probe_seconds, run_training  # noqa: E402
from paper_table.stats import amdahl_bound, classic_amdahl, time_to_accuracy, updates_bound, updates_run  # noqa: E402
from paper_table.trl_compare import run_trl_comparison  # noqa: E402

# the parts tests/test_bench_table.py reaches through this module
__all__ = ["amdahl_bound", "build_report", "classic_amdahl", "fitting_questions", "fmt_pm", "machine",
           "main", "markdown_table", "parse_seeds", "PRUNING_RATES", "questions_per_step", "all_rows",
           "time_to_accuracy", "updates_bound", "updates_run", "write_plots"]

def parse_seeds(text: str) -> list[int]:
    """'3' -> [0, 1, 2]; '0,4,7' -> [0, 4, 7]."""
    text = str(text).strip()
    if "," in text:
        return [int(s) for s in text.split(",") if s.strip()]
    count = int(text)
    if count < 1:
        raise ValueError(f"--seeds must be >= 1 or a comma list, got {text!r}")
    return list(range(count))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="cppo bench", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke mode: {QUICK}")
    parser.add_argument("--output", default="benchmarks/results/cppo_table", help="results folder")
    parser.add_argument("--train_questions", type=int, default=None,
                        help=f"N training questions, one pass (default {DEFAULTS['train_questions']}, "
                             f"quick {QUICK['train_questions']})")
    parser.add_argument("--seeds", default=None,
                        help=f"a count (3 -> seeds 0,1,2) or a comma list (default {DEFAULTS['seeds']})")
    parser.add_argument("--rows", default=None,
                        help="comma list of rows (default: all): " + ", ".join(all_rows()))
    parser.add_argument("--eval_questions", type=int, default=None,
                        help=f"held-out questions per evaluation (default {DEFAULTS['eval_questions']}, "
                             f"quick {QUICK['eval_questions']}; the test split has 988)")
    parser.add_argument("--evals_per_run", type=int, default=None,
                        help=f"held-out evaluations per run, evenly spaced, plus one before "
                             f"(default {DEFAULTS['evals_per_run']}, quick {QUICK['evals_per_run']})")
    parser.add_argument("--learning_rate", type=float, default=DEFAULTS["learning_rate"])
    parser.add_argument("--generation_dtype", default=DEFAULTS["generation_dtype"],
                        choices=["float32", "bfloat16", "policy"],
                        help="sampling weights dtype for every training row ('policy': the "
                             "policy's own float32); the TRL comparison always samples in float32")
    parser.add_argument("--top_p", type=float, default=DEFAULTS["top_p"],
                        help="nucleus sampling for every training row (1.0: off, the paper's)")
    parser.add_argument("--replay_sampling", default=DEFAULTS["replay_sampling"],
                        choices=["auto", "true", "false"],
                        help="whether the training passes replay the sampler's truncation "
                             "(docs/objectives.md); auto: whenever top_p < 1")
    parser.add_argument("--trl_steps", type=int, default=None, help="steps timed in the TRL comparison")
    parser.add_argument("--trl_warmup", type=int, default=None, help="warm-up steps before timing")
    parser.add_argument("--no_estimate", action="store_true", help="skip the timing probe")
    parser.add_argument("--estimate_only", action="store_true",
                        help="run the timing probe, print the estimate and exit")
    parser.add_argument("--from_json", default=None,
                        help="only re-render results.md and the plots from this results.json")
    parser.add_argument("--runs_dir", default=None,
                        help="where the runs' output_dirs go (default: a temporary folder)")
    args = parser.parse_args(argv)
    mode = {**DEFAULTS, **(QUICK if args.quick else {})}
    for key in ("train_questions", "seeds", "trl_steps", "trl_warmup", "eval_questions",
                "evals_per_run"):
        if getattr(args, key) is None:
            setattr(args, key, mode[key])
    if args.rows is None:
        args.rows = mode.get("rows", ",".join(all_rows()))
    args.seed_list = parse_seeds(args.seeds)
    known = all_rows()
    args.row_list = [r.strip() for r in args.rows.split(",") if r.strip()]
    bad = [r for r in args.row_list if r not in known]
    if bad:
        parser.error(f"unknown rows {bad}; known: {', '.join(known)}")
    if "grpo" not in args.row_list and any(known[r].kind != "trl" for r in args.row_list):
        print("note: row 'grpo' not selected; speed-ups and time-to-accuracy need it")
    if args.train_questions < 16:
        parser.error(f"--train_questions must be >= 16 (one CPPO step at P=0.9375), got {args.train_questions}")
    if args.estimate_only and args.no_estimate:
        parser.error("--estimate_only and --no_estimate contradict each other")
    if args.evals_per_run < 1:
        parser.error(f"--evals_per_run must be >= 1, got {args.evals_per_run}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.from_json:
        raw = json.loads(Path(args.from_json).read_text())
        markdown, _ = write_outputs(raw, Path(args.output))
        print(markdown)
        return 0
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()          # no "Loading weights" bar per run
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    known = all_rows()
    rows = [known[n] for n in args.row_list]
    command = "python benchmarks/cppo_table.py " + " ".join(shlex.quote(a) for a in
                                                            (argv if argv is not None else sys.argv[1:]))
    start = time.perf_counter()
    temp = None if args.runs_dir else tempfile.TemporaryDirectory(prefix="cppo_table_")
    runs_dir = Path(args.runs_dir or temp.name)
    raw = {"command": command.strip(), "machine": machine(),
           "started": time.strftime("%Y-%m-%d %H:%M:%S"),
           "settings": {"quick": args.quick, "train_questions": args.train_questions,
                        "seeds": args.seed_list, "rows": args.row_list,
                        "eval_questions": args.eval_questions, "evals_per_run": args.evals_per_run,
                        "learning_rate": args.learning_rate, "group_size": GROUP_SIZE,
                        "update_batch": UPDATE_BATCH, "generation_dtype": args.generation_dtype,
                        "top_p": args.top_p, "replay_sampling": args.replay_sampling},
           "runs": []}
    m = machine_of(raw)
    print(f"cppo table: rows {', '.join(args.row_list)}; seeds {args.seed_list}; "
          f"N = {args.train_questions}; machine {m['platform']}, {m['cores']} CPUs, torch {m['torch']}")
    if not args.no_estimate:
        training, fixed, per_row = probe_seconds(args, rows, args.seed_list, runs_dir)
        estimate = training + fixed
        raw["estimate_seconds"], raw["estimate_per_row"] = estimate, per_row
        print(f"estimated time: {estimate / 60:.1f} min (probe took {time.perf_counter() - start:.0f} s); "
              f"per row: " + ", ".join(f"{k} {v / 60:.1f}" for k, v in per_row.items()) + " min")
        if not args.quick:
            fits = fitting_questions(args.train_questions, training, fixed, TIME_BUDGET_SECONDS)
            print(f"--train_questions that fits in {TIME_BUDGET_SECONDS / 60:.0f} min here: about {fits}"
                  + ("" if estimate <= TIME_BUDGET_SECONDS else " (this table is over budget)"))
        if args.estimate_only:
            if temp is not None:
                temp.cleanup()
            return 0
    try:
        for seed in args.seed_list:            # seeds outside, so slow spells spread over rows
            for row in rows:
                if row.kind == "trl":
                    continue
                t0 = time.perf_counter()
                summary = run_training(args, row, seed, runs_dir)
                raw["runs"].append({"row": row.name, "seed": seed, "summary": summary})
                print(f"  {row.name:>15} seed {seed}: accuracy {100 * summary['accuracy_before']:.1f}% -> "
                      f"{100 * summary['accuracy_after']:.1f}%, {summary['steps']} steps, train "
                      f"{summary['train_seconds']:.1f} s, wall {summary['wall_seconds']:.1f} s "
                      f"({time.perf_counter() - t0:.0f} s with setup)", flush=True)
                raw["total_seconds"] = time.perf_counter() - start
                write_results(output, raw, None, indent=1)   # so far
        if "trl" in args.row_list:
            print("  TRL comparison ...", flush=True)
            raw["trl"] = run_trl_comparison(args, runs_dir)
            trl = raw["trl"]
            print(f"  {'trl':>15}: " + (f"TRL {trl['trl']['seconds_per_step']:.3f} s/step, ours "
                                       f"{trl['ours']['seconds_per_step']:.3f} s/step ({trl['ratio']:.2f}x)"
                                       if "ratio" in trl else trl.get("error", str(trl.get("ours")))))
    finally:
        raw["total_seconds"] = time.perf_counter() - start
        if temp is not None:
            temp.cleanup()
    markdown, targets = write_outputs(raw, output)
    print()
    print(markdown)
    print(f"total wall time {raw['total_seconds'] / 60:.1f} min; wrote {output}/results.md, results.json, "
          f"accuracy_vs_time.png, speedup.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
