"""Running the table's training rows: configs, one run, the time probe that sizes N."""

from __future__ import annotations

import math
import time
from pathlib import Path

from .rows import GROUP_SIZE, Row, questions_per_step


def base_config(args, row: Row, seed: int, output_dir: Path, steps: int | None = None,
                **overrides):
    """The shared recipe plus the row's knobs, for one seed (steps: a fixed max_steps)."""
    from cppo.config import CPPOConfig
    q = questions_per_step(row.pruning_rate) if row.kind in ("cppo", "fair", "ablation") else 1
    total = steps or math.ceil(args.train_questions / q)
    values = dict(model="embedded", dataset_name="embedded", num_generations=GROUP_SIZE, max_completion_length=8,
                  gradient_accumulation_steps=1, num_train_questions=args.train_questions,
                  num_train_epochs=1, max_steps=steps or -1, learning_rate=args.learning_rate,
                  lr_scheduler_type="constant",
                  eval_num_questions=args.eval_questions,
                  eval_steps=max(1, math.ceil(total / args.evals_per_run)),
                  save_steps=0, save_total_limit=1, logging_steps=1, report_to=["jsonl"],
                  progress_bar=False, seed=seed, output_dir=str(output_dir),
                  generation_dtype=None if args.generation_dtype == "policy" else args.generation_dtype,
                  matmul_dtype=None,   # training matmuls in float32 for every row (auto is by batch size)
                  top_p=args.top_p,
                  replay_sampling={"auto": None, "true": True, "false": False}[args.replay_sampling])
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
                trainer.held_out_evaluation(None, start, label="probe")
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
