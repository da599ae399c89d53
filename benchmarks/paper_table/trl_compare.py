"""Seconds per GRPO step, TRL's GRPOTrainer against ours, interleaved."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from .rows import GROUP_SIZE, TRL_ROUNDS, UPDATE_BATCH, all_rows
from .runs import base_config


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
