"""The CPPO paper table on the embedded task, measured honestly (also `cppo bench`).

    python benchmarks/cppo_table.py            # the full table: 3 seeds, every row (~1 h on a 2-core CPU)
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
  trl           seconds per GRPO step and tokens/s, TRL's GRPOTrainer against ours, B = G = 16

Outputs (in --output, default benchmarks/results/cppo_table): results.md (tables, targets,
formulas, the command and the machine), results.json (every run's summary), accuracy_vs_time.png,
speedup.png. docs/benchmarks.md explains the columns.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

GROUP_SIZE = 16                  # G: completions per question (the paper's)
UPDATE_BATCH = 16                # B: completions per optimizer update (the paper's, 1 GPU)
PRUNING_RATES = (0.5, 0.75, 0.875, 0.9375)
PAPER_SPEEDUP = {0.5: 1.81, 0.75: 3.27, 0.875: 4.89, 0.9375: 8.32}   # GSM8K, Qwen2.5-1.5B
ABLATION_RATE = 0.875
ACCURACY_TOLERANCE = 0.01        # CPPO may be at most 1 point below GRPO
BOUND_FRACTION = 0.9             # measured speed-up must reach 90 % of the measured bound
TRL_SPEED_RATIO = 2.0            # our GRPO step must be 2x faster than TRL's
TRL_ROUNDS = 2                   # TRL runs, interleaved with TRL_ROUNDS + 1 runs of ours
TIME_BUDGET_SECONDS = 3600       # the full table should finish within about an hour
TRAIN_PHASES = ("generate", "score", "logprobs", "update")

DEFAULTS = dict(train_questions=1024, seeds="3", eval_questions=500, evals_per_run=4,
                learning_rate=3e-5, trl_steps=30, trl_warmup=5, generation_dtype="policy")
QUICK = dict(train_questions=32, seeds="1", rows="grpo,cppo-0.875,fair-0.875,trl",
             eval_questions=200, evals_per_run=2, trl_steps=5, trl_warmup=2)


# ================================================================ rows ==========================
@dataclass(frozen=True)
class Row:
    """One line of the table: the knobs of CPPOConfig that differ from the shared recipe."""

    name: str
    kind: str                      # grpo | cppo | fair | ablation | trl
    pruning_rate: float = 0.0      # the P this row stands for (fair rows: the CPPO P they match)
    selection_rule: str = "largest_abs"
    selection_scope: str = "step"

    @property
    def label(self) -> str:
        return {"grpo": "GRPO (paper: B = 16)",
                "cppo": f"CPPO P={self.pruning_rate:g}",
                "fair": f"GRPO fair (Q of P={self.pruning_rate:g})",
                "ablation": f"CPPO P={self.pruning_rate:g}, {self.selection_rule}",
                "trl": "TRL GRPOTrainer vs ours"}[self.kind]

    def config_values(self) -> dict:
        """CPPOConfig overrides for this row (B, P, selection); the rest is shared."""
        if self.kind == "grpo":
            return dict(pruning_rate=0.0, per_device_train_batch_size=UPDATE_BATCH)
        if self.kind == "fair":
            return dict(pruning_rate=0.0,
                        per_device_train_batch_size=questions_per_step(self.pruning_rate) * GROUP_SIZE)
        return dict(pruning_rate=self.pruning_rate, allocation=True,
                    per_device_train_batch_size=UPDATE_BATCH, selection_rule=self.selection_rule,
                    selection_scope=self.selection_scope)


def all_rows() -> dict[str, Row]:
    rows = [Row("grpo", "grpo")]
    rows += [Row(f"cppo-{p:g}", "cppo", p) for p in PRUNING_RATES]
    rows += [Row(f"fair-{p:g}", "fair", p) for p in PRUNING_RATES]
    rows += [Row(f"smallest-{ABLATION_RATE:g}", "ablation", ABLATION_RATE, "smallest_abs"),
             Row(f"random-{ABLATION_RATE:g}", "ablation", ABLATION_RATE, "random"),
             Row(f"maxvar-{ABLATION_RATE:g}", "ablation", ABLATION_RATE, "max_variance", "question"),
             Row("trl", "trl")]
    return {r.name: r for r in rows}


def questions_per_step(pruning_rate: float) -> int:
    """Q of CPPO with allocation at P (B = 16, G = 16, scope 'step'): 1/(1-P) here."""
    from cppo.algorithm.allocation import plan_step
    return plan_step(completions_per_update=UPDATE_BATCH, group_size=GROUP_SIZE,
                     pruning_rate=pruning_rate, allocation=True, scope="step").questions_per_step


# ================================================================ pure parts ====================
def mean_std(values) -> tuple[float | None, float | None]:
    """Mean and sample std (0 for one value); (None, None) for no values."""
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def train_split(summary: dict) -> tuple[float, float]:
    """(G, R) of a run: generate+score seconds (pruning cannot shrink them) and the rest of the
    training time R = train_seconds - G (log-prob passes, updates, per-step overhead)."""
    phases = summary["phase_seconds_this_session"]
    gen_score = phases.get("generate", 0.0) + phases.get("score", 0.0)
    return gen_score, summary["train_seconds"] - gen_score


def amdahl_bound(grpo_seconds: float, grpo_gen_score: float, cppo_gen_score: float,
                 pruning_rate: float) -> float:
    """Measured bound on CPPO's speed-up over GRPO:
        bound(P) = T_GRPO / (G_CPPO + (1 - P) * (T_GRPO - G_GRPO))
    T = training seconds, G = generate + score seconds (measured). Generation and scoring are what
    they measurably are in the CPPO run; everything else GRPO spends per step (log-probs, updates,
    per-step overhead) shrinks exactly by (1 - P), because CPPO runs (1 - P) times as many steps of
    the same 16 completions. A CPPO run at 100 % of the bound has no overhead from pruning."""
    if not 0 <= pruning_rate < 1:
        raise ValueError(f"pruning_rate must be in [0, 1), got {pruning_rate}")
    denominator = cppo_gen_score + (1 - pruning_rate) * (grpo_seconds - grpo_gen_score)
    if denominator <= 0:
        raise ValueError(f"non-positive time in the bound: G_CPPO={cppo_gen_score}, "
                         f"T_GRPO={grpo_seconds}, G_GRPO={grpo_gen_score}")
    return grpo_seconds / denominator


def classic_amdahl(reducible_fraction: float, pruning_rate: float) -> float:
    """Textbook Amdahl: 1 / ((1 - f) + f (1 - P)), f = fraction of GRPO's time that pruning
    shrinks. It keeps GRPO's generation time, so batching generation can beat it."""
    if not 0 <= reducible_fraction <= 1:
        raise ValueError(f"reducible_fraction must be in [0, 1], got {reducible_fraction}")
    return 1.0 / ((1 - reducible_fraction) + reducible_fraction * (1 - pruning_rate))


def time_to_accuracy(history: list[dict], target: float, clock: str = "train_seconds"
                     ) -> float | None:
    """Seconds on `clock` ('train_seconds' or 'wall_time') at which the held-out accuracy first
    reaches `target`, linearly interpolated between the eval before and the first eval at or above
    it; 0 if the first eval already reaches it; None if no eval does ("not reached")."""
    previous = None
    for point in history:
        if point["accuracy"] >= target:
            if previous is None:
                return float(point[clock]) if point["step"] else 0.0
            a0, a1 = previous["accuracy"], point["accuracy"]
            t0, t1 = float(previous[clock]), float(point[clock])
            return t0 + (t1 - t0) * (target - a0) / (a1 - a0)
        previous = point
    return None


def markdown_table(headers: list[str], rows: list[list], align: str | None = None) -> str:
    """A GitHub markdown table; align is one of 'l', 'r', 'c' per column (default: l then r)."""
    align = align or "l" + "r" * (len(headers) - 1)
    if len(align) != len(headers):
        raise ValueError(f"align has {len(align)} entries for {len(headers)} columns")
    marks = {"l": ":---", "r": "---:", "c": ":---:"}
    cells = [[str(c) for c in row] for row in rows]
    for i, row in enumerate(cells):
        if len(row) != len(headers):
            raise ValueError(f"row {i} has {len(row)} cells for {len(headers)} columns: {row}")
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(marks[a] for a in align) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(lines)


def fmt_pm(mean: float | None, std: float | None, scale: float = 1.0, digits: int = 1,
           suffix: str = "") -> str:
    if mean is None:
        return "n/a"
    text = f"{scale * mean:.{digits}f}{suffix}"
    return text + (f" ± {scale * std:.{digits}f}" if std else "")


def fmt_num(value: float | None, digits: int = 1, suffix: str = "") -> str:
    if value is None:
        return "n/a"
    text = f"{value:.{digits}f}"
    return (text[1:] if text.startswith("-") and float(text) == 0 else text) + suffix   # no "-0.0"


# ================================================================ aggregation ===================
def by_seed(runs: list[dict], name: str) -> dict[int, dict]:
    return {r["seed"]: r["summary"] for r in runs if r["row"] == name}


def row_stats(runs: list[dict], name: str, grpo: dict[int, dict], target: float | None) -> dict:
    """Everything one table row shows, from its per-seed summaries (GRPO's paired by seed)."""
    mine = by_seed(runs, name)
    summaries = list(mine.values())
    stats: dict = {"row": name, "seeds": sorted(mine)}
    if not summaries:
        return stats
    acc = mean_std(s["accuracy_after"] for s in summaries)
    stats.update(
        accuracy=acc, accuracy_before=mean_std(s["accuracy_before"] for s in summaries),
        train_seconds=mean_std(s["train_seconds"] for s in summaries),
        wall_seconds=mean_std(s["wall_seconds"] for s in summaries),
        steps=summaries[0]["steps"], questions_per_step=summaries[0]["questions_per_step"],
        kept_per_step=summaries[0]["completions_kept_per_step"],
        effective_pruning_rate=summaries[0]["effective_pruning_rate"],
        skipped_steps=mean_std(s["skipped_steps"] for s in summaries)[0])
    phases = {}
    for key in TRAIN_PHASES + ("eval", "checkpoint"):
        phases[key] = mean_std(s["phase_seconds_this_session"].get(key, 0.0) for s in summaries)[0]
    phases["other"] = stats["train_seconds"][0] - sum(phases[k] for k in TRAIN_PHASES)
    stats["phases"] = phases
    paired = [s for s in mine if s in grpo]
    if paired:
        t_grpo = statistics.fmean(grpo[s]["train_seconds"] for s in paired)
        w_grpo = statistics.fmean(grpo[s]["wall_seconds"] for s in paired)
        stats["speedup_train"] = t_grpo / statistics.fmean(mine[s]["train_seconds"] for s in paired)
        stats["speedup_wall"] = w_grpo / statistics.fmean(mine[s]["wall_seconds"] for s in paired)
        stats["speedup_train_per_seed"] = [grpo[s]["train_seconds"] / mine[s]["train_seconds"]
                                           for s in paired]
        p = summaries[0]["effective_pruning_rate"]
        if summaries[0]["completions_kept_per_step"] < summaries[0]["questions_per_step"] * GROUP_SIZE:
            g_grpo = statistics.fmean(train_split(grpo[s])[0] for s in paired)
            g_mine = statistics.fmean(train_split(mine[s])[0] for s in paired)
            stats["bound"] = amdahl_bound(t_grpo, g_grpo, g_mine, p)
            stats["classic_amdahl"] = classic_amdahl(1 - g_grpo / t_grpo, p)
            stats["fraction_of_bound"] = stats["speedup_train"] / stats["bound"]
    if target is not None:
        reached = [time_to_accuracy(s["history"], target, "train_seconds") for s in summaries]
        reached_wall = [time_to_accuracy(s["history"], target, "wall_time") for s in summaries]
        stats["time_to_target"] = mean_std(reached)
        stats["time_to_target_wall"] = mean_std(reached_wall)
        stats["reached"] = sum(t is not None for t in reached)
    return stats


def fair_stats(runs: list[dict], pruning_rate: float) -> dict:
    """CPPO-P against the fair GRPO baseline with the same questions per step (paired by seed)."""
    cppo, fair = by_seed(runs, f"cppo-{pruning_rate:g}"), by_seed(runs, f"fair-{pruning_rate:g}")
    paired = sorted(set(cppo) & set(fair))
    if not paired:
        return {}
    t_fair = statistics.fmean(fair[s]["train_seconds"] for s in paired)
    t_cppo = statistics.fmean(cppo[s]["train_seconds"] for s in paired)
    g_fair = statistics.fmean(train_split(fair[s])[0] for s in paired)
    g_cppo = statistics.fmean(train_split(cppo[s])[0] for s in paired)
    p = cppo[paired[0]]["effective_pruning_rate"]
    return {"speedup_train": t_fair / t_cppo, "bound": amdahl_bound(t_fair, g_fair, g_cppo, p),
            "accuracy_fair": mean_std(fair[s]["accuracy_after"] for s in paired),
            "accuracy_cppo": mean_std(cppo[s]["accuracy_after"] for s in paired),
            "train_fair": t_fair, "train_cppo": t_cppo, "seeds": paired}


def evaluate_targets(stats: dict[str, dict], trl: dict | None, total_seconds: float | None,
                     quick: bool) -> list[dict]:
    """The issue's targets as (target, measured, met) rows; met is None when not measured."""
    out = []
    grpo = stats.get("grpo", {})
    grpo_acc = grpo.get("accuracy", (None, None))[0]
    for p in PRUNING_RATES:
        s = stats.get(f"cppo-{p:g}", {})
        if "speedup_train" not in s or grpo_acc is None:
            out.append({"target": f"P={p:g}: speed-up >= {PAPER_SPEEDUP[p]}x at accuracy >= GRPO - 1 pt",
                        "measured": "not run", "met": None})
            out.append({"target": f"P={p:g}: speed-up >= {BOUND_FRACTION:.0%} of the measured bound",
                        "measured": "not run", "met": None})
            continue
        acc, speed = s["accuracy"][0], s["speedup_train"]
        ok = speed >= PAPER_SPEEDUP[p] and acc >= grpo_acc - ACCURACY_TOLERANCE
        out.append({"target": f"P={p:g}: speed-up >= {PAPER_SPEEDUP[p]}x at accuracy >= GRPO - 1 pt",
                    "measured": f"{speed:.2f}x, accuracy {100 * acc:.1f}% vs GRPO "
                                f"{100 * grpo_acc:.1f}% ({100 * (acc - grpo_acc):+.1f} pt)",
                    "met": ok})
        if "bound" in s:
            out.append({"target": f"P={p:g}: speed-up >= {BOUND_FRACTION:.0%} of the measured bound",
                        "measured": f"{speed:.2f}x of {s['bound']:.2f}x = "
                                    f"{100 * s['fraction_of_bound']:.0f}%",
                        "met": s["fraction_of_bound"] >= BOUND_FRACTION})
    if trl and trl.get("ratio") is not None:
        out.append({"target": f"our GRPO step >= {TRL_SPEED_RATIO:g}x faster than TRL's",
                    "measured": f"{trl['ratio']:.2f}x ({trl['trl']['seconds_per_step']:.3f} s vs "
                                f"{trl['ours']['seconds_per_step']:.3f} s per step)",
                    "met": trl["ratio"] >= TRL_SPEED_RATIO})
    else:
        reason = (trl or {}).get("error", "not run")
        out.append({"target": f"our GRPO step >= {TRL_SPEED_RATIO:g}x faster than TRL's",
                    "measured": reason, "met": None})
    if total_seconds is not None:
        out.append({"target": f"full table in <= {TIME_BUDGET_SECONDS / 60:.0f} min",
                    "measured": f"{total_seconds / 60:.1f} min" + (" (quick mode: not the full table)"
                                                                   if quick else ""),
                    "met": None if quick else total_seconds <= TIME_BUDGET_SECONDS * 1.05})
    return out


# ================================================================ running =======================
def base_config(args, row: Row, seed: int, output_dir: Path, steps: int | None = None,
                **overrides):
    """The shared recipe plus the row's knobs, for one seed (steps: a fixed max_steps)."""
    from cppo.config import CPPOConfig
    q = questions_per_step(row.pruning_rate) if row.kind in ("cppo", "fair", "ablation") else 1
    total = steps or math.ceil(args.train_questions / q)
    values = dict(model="embedded", dataset_name="embedded", num_generations=GROUP_SIZE,
                  gradient_accumulation_steps=1, num_train_questions=args.train_questions,
                  num_train_epochs=1, max_steps=steps or -1, learning_rate=args.learning_rate,
                  lr_scheduler_type="constant",
                  eval_num_questions=args.eval_questions,
                  eval_steps=max(1, math.ceil(total / args.evals_per_run)),
                  save_steps=0, save_total_limit=1, logging_steps=1, report_to=["jsonl"],
                  progress_bar=False, seed=seed, output_dir=str(output_dir),
                  generation_dtype=None if args.generation_dtype == "policy" else args.generation_dtype)
    values.update(row.config_values())
    values.update(overrides)
    return CPPOConfig(**values)


def run_training(args, row: Row, seed: int, runs_dir: Path) -> dict:
    """One in-process CPPOTrainer run; returns its summary (plus the outer setup+run seconds)."""
    import contextlib
    import io
    from cppo.trainer import CPPOTrainer
    out = runs_dir / f"{row.name}_seed{seed}"
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):   # the trainer prints its own summary
        summary = CPPOTrainer(args=base_config(args, row, seed, out)).train()
    summary["run_seconds"] = round(time.perf_counter() - start, 2)
    return summary


def probe_seconds(args, rows: list[Row], seeds: list[int], runs_dir: Path
                  ) -> tuple[float, float, dict]:
    """Estimate the table's time: time 2 training rounds (1 in quick mode) after 1 warm-up and
    1 evaluation for each row's shape, then scale by its steps and evaluations.
    Returns (training seconds, fixed seconds, total seconds per row)."""
    import contextlib
    import io
    from cppo.trainer import CPPOTrainer
    per_row, eval_seconds, training, fixed = {}, None, 0.0, 0.0
    timed_rounds = 1 if args.quick else 2
    for row in rows:
        if row.kind == "trl":
            per_row[row.name] = 3 * (args.trl_warmup + args.trl_steps) * 1.0 + 20
            fixed += per_row[row.name]
            continue
        cfg = base_config(args, row, seeds[0], runs_dir / f"probe_{row.name}", steps=1 + timed_rounds)
        with contextlib.redirect_stdout(io.StringIO()):
            trainer = CPPOTrainer(args=cfg)
            trainer.training_round()
            start = time.perf_counter()
            for _ in range(timed_rounds):
                trainer.training_round()
            per_round = (time.perf_counter() - start) / timed_rounds
            if eval_seconds is None:
                start = time.perf_counter()
                trainer._evaluate(None, start, label="probe")
                eval_seconds = time.perf_counter() - start
        steps = math.ceil(args.train_questions / trainer.plan.questions_per_step)
        row_training = steps * per_round * len(seeds)
        row_fixed = ((args.evals_per_run + 1) * eval_seconds + 2) * len(seeds)
        per_row[row.name] = row_training + row_fixed
        training, fixed = training + row_training, fixed + row_fixed
    return training, fixed, per_row


def fitting_questions(train_questions: int, training: float, fixed: float, budget: float) -> int:
    """The N (a multiple of 16) whose table fits the budget: training time scales linearly in N,
    the fixed part (evaluations, setup, the TRL row) does not."""
    return max(16, int(train_questions * (budget - fixed) / max(training, 1e-9)) // 16 * 16)


def run_trl_comparison(args, runs_dir: Path) -> dict:
    """Seconds per GRPO step (step end to step end, after a warm-up) and completion tokens/s:
    TRL's GRPOTrainer and ours, same model, questions, G = B = 16, 1 question per step."""
    result = {"warmup_steps": args.trl_warmup, "measured_steps": args.trl_steps}
    steps = args.trl_warmup + args.trl_steps
    try:
        import trl
        result["trl_version"] = trl.__version__
    except ImportError:
        trl = None
        result["error"] = "TRL not installed (pip install 'cppo[bench]')"
    ours, theirs = [], []
    rounds = TRL_ROUNDS if trl else 1
    for index in range(rounds + 1 if trl else 1):   # ours, TRL, ours, TRL, ..., ours
        try:
            ours.append(ours_step_seconds(args, runs_dir / f"ours{index}", steps))
        except Exception as err:  # noqa: BLE001 - a broken comparison must not end the table
            result["ours"] = {"error": f"{type(err).__name__}: {err}"}
        if trl and index < rounds:
            try:
                theirs.append(trl_step_seconds(args, runs_dir / f"trl{index}", steps))
            except Exception as err:  # noqa: BLE001
                result["error"] = f"TRL run failed: {type(err).__name__}: {err}"
    if theirs:
        result["trl"] = pooled_step_seconds(theirs)
    if ours and "ours" not in result:
        result["ours"] = pooled_step_seconds(ours)
    if "trl" in result and "seconds_per_step" in result.get("ours", {}):
        result["ratio"] = result["trl"]["seconds_per_step"] / result["ours"]["seconds_per_step"]
    return result


def pooled_step_seconds(runs: list[dict]) -> dict:
    """Seconds per step and tokens/s over several timed runs ({"periods", "tokens"} each)."""
    periods = [p for run in runs for p in run["periods"]]
    return {"seconds_per_step": statistics.median(periods),
            "mean_seconds_per_step": statistics.fmean(periods),
            "tokens_per_s": sum(run["tokens"] for run in runs) / sum(periods),
            "steps": len(periods), "periods": periods,
            "per_run_median": [statistics.median(run["periods"]) for run in runs]}


def _periods(ends: list[float], warmup: int) -> list[float]:
    """Step periods after the warm-up, from the times at which steps ended."""
    return [b - a for a, b in zip(ends[warmup - 1:], ends[warmup:])] if warmup >= 1 else \
        [b - a for a, b in zip(ends, ends[1:])]


def ours_step_seconds(args, runs_dir: Path, steps: int) -> dict:
    import contextlib
    import io
    from cppo.trainer import CPPOTrainer
    cfg = base_config(args, all_rows()["grpo"], 0, runs_dir / "trl_ours", steps=steps,
                      eval_steps=0, eval_num_questions=16, generation_dtype=None)  # TRL: float32
    trainer = CPPOTrainer(args=cfg)
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    log = [json.loads(line) for line in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    steps_log = [r for r in log if "throughput/tokens_per_s" in r]
    periods = _periods([r["wall_time"] for r in steps_log], args.trl_warmup)
    tokens = sum(r["completions/mean_length"] * r["cppo/completions_scored"]
                 for r in steps_log[args.trl_warmup:])
    return {"periods": periods, "tokens": tokens}


def trl_step_seconds(args, runs_dir: Path, steps: int) -> dict:
    import contextlib
    import io
    import warnings
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from cppo.data.sources import embedded_task
    from cppo.models import load_model, load_tokenizer
    from cppo.rewards import get_reward_function

    reward = get_reward_function("arithmetic")
    counted: list[int] = []

    def arithmetic_reward(prompts, completions, completion_ids=None, **columns):
        counted.append(sum(len(ids) for ids in completion_ids))
        return reward(prompts=prompts, completions=completions, **columns)

    ends: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, *a, **k):
            ends.append(time.perf_counter())

    task = embedded_task(3, seed=0, num_train=max(64, steps))
    config = GRPOConfig(
        output_dir=str(runs_dir / "trl"), per_device_train_batch_size=UPDATE_BATCH,
        num_generations=GROUP_SIZE, max_completion_length=8, max_steps=steps,
        learning_rate=args.learning_rate, lr_scheduler_type="constant", beta=0.0, loss_type="dapo",
        scale_rewards="group", num_iterations=1, epsilon=0.2, temperature=1.0, adam_beta2=0.99,
        max_grad_norm=1.0, gradient_checkpointing=False, use_cpu=True, bf16=False,
        report_to="none", save_strategy="no", logging_steps=steps + 1, disable_tqdm=True,
        seed=0, dataloader_num_workers=0)
    tokenizer = load_tokenizer("embedded")
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):  # TRL prints logs
        warnings.simplefilter("ignore")
        trainer = GRPOTrainer(model=load_model("embedded"), reward_funcs=[arithmetic_reward],
                              args=config, train_dataset=Dataset.from_list(task.train_rows),
                              processing_class=tokenizer, callbacks=[StepClock()])
        trainer.train()
    periods = _periods(ends, args.trl_warmup)
    return {"periods": periods, "tokens": sum(counted[args.trl_warmup:])}


# ================================================================ report ========================
def fmt_list(values) -> str:
    return ", ".join(f"{v:.3f}" for v in values) if isinstance(values, list) else "n/a"


def machine() -> dict:
    import torch
    info = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "python": platform.python_version()}
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def build_report(raw: dict) -> tuple[str, dict, list[dict]]:
    """The markdown of results.md, the per-row stats and the target rows, from the raw JSON."""
    runs, settings, rows = raw["runs"], raw["settings"], all_rows()
    grpo = by_seed(runs, "grpo")
    target = mean_std(s["accuracy_after"] for s in grpo.values())[0]
    names = [n for n in settings["rows"] if n != "trl"]
    stats = {n: row_stats(runs, n, grpo, target) for n in names}
    trl = raw.get("trl")
    targets = evaluate_targets(stats, trl, raw.get("total_seconds"), settings["quick"])

    pct = lambda v: fmt_pm(*v, scale=100, digits=1) if v else "n/a"
    lines = [f"# CPPO paper table on the embedded task{' (QUICK MODE: smoke test only)' if settings['quick'] else ''}",
             "", f"Command: `{raw['command']}`  ",
             f"Machine: {raw['machine']['platform']}, {raw['machine']['cpu_count']} CPUs "
             f"({raw['machine']['torch_threads']} torch threads), torch {raw['machine']['torch']}, "
             f"transformers {raw['machine'].get('transformers', '?')}, Python {raw['machine']['python']}  ",
             f"Started {raw['started']}; total wall time {fmt_num(raw.get('total_seconds', 0) / 60, 1)} min "
             f"(estimate before starting: {fmt_num(raw.get('estimate_seconds', 0) / 60, 1)} min)  ",
             f"Recipe: embedded model and task (2x2-digit multiplication), N = {settings['train_questions']} "
             f"training questions, one pass (num_train_epochs=1, max_steps=-1), G = {GROUP_SIZE}, "
             f"lr {settings['learning_rate']:g} constant, AdamW, beta 0, loss dapo, 1 update per batch, "
             f"temperature 1.0, sampling weights in {settings.get('generation_dtype', 'policy')} "
             f"(TRL comparison: float32); seeds {settings['seeds']}; held-out greedy accuracy on "
             f"{settings['eval_questions']} test questions every ~{100 // settings['evals_per_run']} % "
             f"of a run. Speed-ups use training seconds (train_seconds: the trainer's rounds, "
             f"without evaluation and checkpoints); wall seconds add evaluation and the final checkpoint.",
             "", "## Main table (paper protocol: B = 16 completions per update for every row)", ""]
    head = ["row", "P", "Q/step", "steps", "accuracy %", "Δ vs GRPO pt", "train s", "wall s",
            "speed-up (train)", "speed-up (wall)", "paper", "bound", "% of bound",
            "time to GRPO acc (train s)", "reached"]
    body = []
    for n in names:
        s = stats[n]
        if "accuracy" not in s:
            continue
        r = rows[n]
        delta = None if target is None else 100 * (s["accuracy"][0] - target)
        tta = s.get("time_to_target", (None, None))
        body.append([r.label, f"{r.pruning_rate:g}" if r.kind in ("cppo", "ablation") else "0",
                     s["questions_per_step"], s["steps"], pct(s["accuracy"]),
                     fmt_num(delta, 1) if delta is not None else "n/a",
                     fmt_pm(*s["train_seconds"]), fmt_pm(*s["wall_seconds"]),
                     fmt_num(s.get("speedup_train"), 2, "x"), fmt_num(s.get("speedup_wall"), 2, "x"),
                     f"{PAPER_SPEEDUP[r.pruning_rate]}x" if r.kind == "cppo" else "",
                     fmt_num(s.get("bound"), 2, "x"),
                     fmt_num(100 * s["fraction_of_bound"], 0, "%") if "fraction_of_bound" in s else "",
                     fmt_pm(*tta) if tta[0] is not None else "not reached",
                     f"{s.get('reached', 0)}/{len(s['seeds'])}"])
    lines += [markdown_table(head, body, "lrrrrrrrrrrrrrr"), ""]
    lines += ["Accuracy before training: " + pct(stats["grpo"]["accuracy_before"]) if "accuracy_before" in stats.get("grpo", {}) else "", ""]

    fair_rows = []
    for p in PRUNING_RATES:
        f = fair_stats(runs, p)
        if f:
            fair_rows.append([f"{p:g}", questions_per_step(p), pct(f["accuracy_cppo"]), pct(f["accuracy_fair"]),
                              fmt_num(f["train_cppo"]), fmt_num(f["train_fair"]),
                              fmt_num(f["speedup_train"], 2, "x"), fmt_num(f["bound"], 2, "x"),
                              fmt_num(100 * f["speedup_train"] / f["bound"], 0, "%")])
    if fair_rows:
        lines += ["## CPPO against the fair GRPO baseline (same questions per step, all 16 Q "
                  "completions trained, one update per step)", "",
                  markdown_table(["P", "Q/step", "CPPO accuracy %", "fair GRPO accuracy %",
                                  "CPPO train s", "fair GRPO train s", "speed-up", "bound vs fair",
                                  "% of bound"], fair_rows), ""]

    phase_rows = []
    for n in names:
        s = stats[n]
        if "phases" in s:
            ph = s["phases"]
            phase_rows.append([rows[n].label] + [fmt_num(ph[k], 1) for k in
                              ("generate", "score", "logprobs", "update", "other", "eval", "checkpoint")]
                              + [fmt_num(100 * (ph["generate"] + ph["score"]) / max(s["train_seconds"][0], 1e-9), 0, "%")])
    lines += ["## Where the time goes (seconds, mean over seeds)", "",
              "train_seconds = generate + score + logprobs + update + other (other: per-step "
              "bookkeeping outside the timed phases); wall adds eval and checkpoint.", "",
              markdown_table(["row", "generate", "score", "logprobs", "update", "other", "eval",
                              "checkpoint", "gen+score share"], phase_rows), ""]

    lines += ["## TRL's GRPOTrainer against ours (GRPO, B = G = 16, one question per step, "
              "max 8 new tokens, CPU)", ""]
    if trl is None:
        lines += ["Not run (row 'trl' not selected).", ""]
    else:
        ours, theirs = trl.get("ours", {}), trl.get("trl", {})
        cell = lambda d, k, dig: fmt_num(d.get(k), dig) if isinstance(d, dict) else "n/a"
        table = [["ours (CPPOTrainer, P=0)", cell(ours, "seconds_per_step", 3), cell(ours, "tokens_per_s", 0), ""],
                 [f"TRL {trl.get('trl_version', '(not installed)')} GRPOTrainer",
                  cell(theirs, "seconds_per_step", 3), cell(theirs, "tokens_per_s", 0),
                  fmt_num(trl.get("ratio"), 2, "x") if trl.get("ratio") else trl.get("error", "n/a")]]
        lines += [markdown_table(["trainer", "s/step (median)", "completion tokens/s", "ours faster by"], table), "",
                  f"{trl['measured_steps']} steps measured after {trl['warmup_steps']} warm-up steps per "
                  f"run; runs interleaved (ours, TRL, ours, TRL, ours) and each side's steps pooled; "
                  f"per-run medians: ours {fmt_list(ours.get('per_run_median'))}, TRL "
                  f"{fmt_list(theirs.get('per_run_median'))} s. A step is timed from the end "
                  "of one optimizer step to the end of the next (generation, scoring, update, logging; "
                  "ours logs every step, TRL not at all). TRL: gradient_checkpointing off, beta 0, loss "
                  "dapo, use_cpu, bf16 off." + (f" Ours failed: {ours['error']}" if "error" in ours else ""), ""]

    lines += ["## Targets", "", markdown_table(
        ["target", "measured", "met"],
        [[t["target"], t["measured"], {True: "met", False: "NOT met", None: "n/a"}[t["met"]]]
         for t in targets], "llc"), ""]
    lines += ["## Formulas", "",
              "- speed-up (train) = mean T_GRPO / mean T_row over the seeds both ran, T = train_seconds "
              "(the trainer's rounds: generate, score, log-probs, update, bookkeeping; no evaluation, no "
              "checkpoints). speed-up (wall) uses wall_seconds (adds the evaluations and the final checkpoint).",
              "- bound(P) = T_GRPO / (G_CPPO + (1 - P) · (T_GRPO - G_GRPO)), G = measured generate + score "
              "seconds. What pruning can at best give when generation and scoring take what they measurably "
              "take in the CPPO run and everything else GRPO does per step shrinks by (1 - P) (CPPO runs (1 - P) "
              "times the steps on the same 16 completions). % of bound = speed-up / bound. Against the fair "
              "baseline, T_GRPO and G_GRPO are the fair run's.",
              "- classic Amdahl (in speedup.png) = 1 / ((1 - f) + f (1 - P)), f = (T_GRPO - G_GRPO) / T_GRPO: "
              "keeps GRPO's own generation time, so CPPO's bigger generation batches can beat it.",
              "- ideal = 1 / (1 - P).",
              "- time to GRPO acc: training seconds until the held-out accuracy first reaches the mean final "
              "accuracy of the GRPO (paper) row, linearly interpolated between the eval before and the first "
              "eval at or above it; mean over the seeds that reached it (reached = seeds that did).",
              "- accuracy: held-out greedy accuracy after the last step, mean ± sample std over seeds.", ""]
    return "\n".join(lines), stats, targets


def write_plots(raw: dict, stats: dict, output: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs, rows = raw["runs"], all_rows()
    written = []
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    for name in (n for n in raw["settings"]["rows"] if n != "trl"):
        histories = [s["history"] for s in by_seed(runs, name).values()]
        if not histories:
            continue
        points = min(len(h) for h in histories)
        acc = [statistics.fmean(100 * h[i]["accuracy"] for h in histories) for i in range(points)]
        for ax, clock in zip(axes, ("train_seconds", "wall_time")):
            x = [statistics.fmean(h[i][clock] for h in histories) for i in range(points)]
            style = "-" if rows[name].kind in ("grpo", "cppo") else (":" if rows[name].kind == "fair" else "--")
            ax.plot(x, acc, style, marker="o", ms=3, label=rows[name].label)
    target = stats.get("grpo", {}).get("accuracy", (None, None))[0]
    for ax, title in zip(axes, ("training seconds (no eval, no checkpoints)", "wall seconds (with eval)")):
        if target is not None:
            ax.axhline(100 * target, color="gray", lw=0.8, ls="--")
        ax.set_xlabel(title)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out greedy accuracy % (mean over seeds)")
    axes[1].legend(fontsize=7, loc="lower right")
    fig.suptitle("Held-out accuracy against time, per method (dashed: GRPO's final accuracy)")
    fig.tight_layout()
    path = output / "accuracy_vs_time.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)

    fig, ax = plt.subplots(figsize=(7, 5))
    grid = [i / 100 for i in range(0, 95)] + [0.9375]
    ax.plot(grid, [1 / (1 - p) for p in grid], "k:", label="ideal 1/(1-P)")
    ax.plot(list(PAPER_SPEEDUP), list(PAPER_SPEEDUP.values()), "s--", color="gray", label="paper (GSM8K)")
    measured = [(p, stats[f"cppo-{p:g}"]) for p in PRUNING_RATES if "speedup_train" in stats.get(f"cppo-{p:g}", {})]
    if measured:
        ps = [p for p, _ in measured]
        ax.errorbar(ps, [s["speedup_train"] for _, s in measured],
                    yerr=[mean_std(s["speedup_train_per_seed"])[1] for _, s in measured],
                    fmt="o-", color="C0", capsize=3, label="measured vs GRPO (B = 16)")
        ax.plot(ps, [s["bound"] for _, s in measured], "^--", color="C1", label="measured bound")
        ax.plot(ps, [s["classic_amdahl"] for _, s in measured], "v:", color="C2", label="classic Amdahl")
    fair = [(p, fair_stats(runs, p)) for p in PRUNING_RATES]
    fair = [(p, f) for p, f in fair if f]
    if fair:
        ax.plot([p for p, _ in fair], [f["speedup_train"] for _, f in fair], "D-", color="C3",
                label="measured vs fair GRPO (same Q)")
    ax.set_yscale("log", base=2)
    ax.set_xlabel("pruning rate P")
    ax.set_ylabel("speed-up in training seconds")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax.set_title("CPPO speed-up against P")
    fig.tight_layout()
    path = output / "speedup.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)
    return written


def write_outputs(raw: dict, output: Path) -> tuple[str, list[dict]]:
    output.mkdir(parents=True, exist_ok=True)
    markdown, stats, targets = build_report(raw)
    raw["stats"], raw["targets"] = stats, targets
    (output / "results.json").write_text(json.dumps(raw, indent=1, default=str))
    (output / "results.md").write_text(markdown)
    write_plots(raw, stats, output)
    return markdown, targets


# ================================================================ main ==========================
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
                        "update_batch": UPDATE_BATCH, "generation_dtype": args.generation_dtype},
           "runs": []}
    print(f"cppo table: rows {', '.join(args.row_list)}; seeds {args.seed_list}; "
          f"N = {args.train_questions}; machine {raw['machine']['platform']}, "
          f"{raw['machine']['cpu_count']} CPUs, torch {raw['machine']['torch']}")
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
                (output / "results.json").write_text(json.dumps(raw, indent=1, default=str))
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
