"""When bfloat16 training matmuls pay on a CPU: the update step, float32 against `matmul_dtype`.

For each model and micro-batch size, one CPPOTrainer runs training rounds whose update
(`trainer.update`: the policy's forward and backward over the kept completions, the optimizer
step) alternates between float32 matmuls (`matmul_dtype: none`) and bfloat16 ones for the decoder
layers' Linear layers (`matmul_dtype: bfloat16`); after two warm-up rounds, --repeats updates of
each are timed and the medians compared. Each point is also given the micro-batch's linear-layer
work (per_device_train_batch_size x max_completion_length x multiply-adds per token) and what
`matmul_dtype: auto` picks there (`hardware.auto_matmul_dtype`).

Models: `embedded` (the shipped tiny Llama and task, G = 8, P = 0.75: the default recipe at
several micro-batch sizes) and `real_shape` (benchmarks/real_shape.py's random 0.12B Qwen2, 32k
vocabulary, one question of G completions, 32 new tokens).

    python benchmarks/update_precision.py
    python benchmarks/update_precision.py --models embedded --repeats 20

Writes benchmarks/results/update_precision/results.md and results.json.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from sampling_precision import (arguments, header_lines, real_shape_inputs, run_meta,  # noqa: E402
                                write_results)
# per_device_train_batch_size (completions per update)
POINTS = {"embedded": [16, 64, 256, 512], "real_shape": [4, 16]}
NEW_TOKENS = {"embedded": 5, "real_shape": 32}


def length_reward(completions, **kwargs):
    """Varied rewards, so that every group has advantages to train on."""
    return [float(len(c) % 3) for c in completions]


def trainer_for(name: str, model: str | None, rows, batch: int):
    from cppo.config import CPPOConfig
    from cppo.trainer import CPPOTrainer
    shape = (dict(num_generations=8, pruning_rate=0.75) if name == "embedded"
             else dict(num_generations=batch, pruning_rate=0.0, max_prompt_length=128))
    cfg = CPPOConfig(output_dir=tempfile.mkdtemp(prefix="cppo_update_precision_"),
                     per_device_train_batch_size=batch, max_completion_length=NEW_TOKENS[name],
                     matmul_dtype=None, eval_steps=0, save_steps=0, progress_bar=False,
                     report_to=[], **shape, **({"model": model} if model else {}))
    with contextlib.redirect_stdout(io.StringIO()):
        if model is None:
            return CPPOTrainer(args=cfg)
        return CPPOTrainer(args=cfg, train_dataset=rows, reward_funcs=[length_reward])


def measure(name: str, model: str | None, rows, batch: int, repeats: int) -> dict:
    from cppo.parallel import hardware
    from cppo.parallel.memory import ModelShape
    trainer = trainer_for(name, model, rows, batch)
    update, current = trainer.update, {"dtype": None}
    seconds = {None: [], "bfloat16": []}

    def timed_update(step_batch):
        start = time.perf_counter()
        out = update(step_batch)
        seconds[current["dtype"]].append(time.perf_counter() - start)
        return out
    trainer.update = timed_update
    for i in range(2 * repeats + 2):                    # rounds 0 and 1 warm up, one of each
        current["dtype"] = trainer.learner.matmul_dtype = (None, "bfloat16")[i % 2]
        with contextlib.redirect_stdout(io.StringIO()):
            trainer.training_round()
    for dtype in seconds:
        seconds[dtype] = seconds[dtype][1:]
    work = batch * NEW_TOKENS[name] * ModelShape.from_config(trainer.policy.config).multiply_adds_per_token()
    f32, bf16 = (statistics.median(seconds[d]) for d in (None, "bfloat16"))
    return {"model": name, "batch": batch, "micro_batch_multiply_adds": work,
            "float32_ms": round(1000 * f32, 1), "bfloat16_ms": round(1000 * bf16, 1),
            "ratio": round(bf16 / f32, 2),
            "float32_range_ms": [round(1000 * min(seconds[None]), 1), round(1000 * max(seconds[None]), 1)],
            "bfloat16_range_ms": [round(1000 * min(seconds["bfloat16"]), 1),
                                  round(1000 * max(seconds["bfloat16"]), 1)],
            "auto_picks": hardware.auto_matmul_dtype(trainer.policy.dtype, "cpu", True, work) or "float32"}


def write(rows: list[dict], meta: dict, out: Path) -> None:
    from cppo.parallel.hardware import BF16_MIN_DECODE_MULTIPLY_ADDS
    lines = header_lines(f"Update precision on a CPU (`python benchmarks/update_precision.py "
                         f"{meta['argv']}`)", meta) + [
             f"One update (`trainer.update`: forward, backward and optimizer step over the kept "
             f"completions), median of {meta['repeats']} alternating updates per dtype (range in "
             f"brackets). `auto` runs the decoder's Linear matmuls in bfloat16 on a CPU when a "
             f"micro-batch has at least {BF16_MIN_DECODE_MULTIPLY_ADDS:.0e} multiply-adds.", "",
             "| model | completions per update | multiply-adds per micro-batch | float32 ms | "
             "bfloat16 matmuls ms | bf16 / f32 | auto picks |", "|---|---|---|---|---|---|---|"]
    write_results(lines, rows, "batch", "micro_batch_multiply_adds", meta, out)


def main() -> None:
    args = arguments(__doc__, POINTS, "update_precision")
    load_before = os.getloadavg()[0]
    rows = []
    for name in args.models:
        model, data = real_shape_inputs(args.assets) if name == "real_shape" else (None, None)
        for batch in POINTS[name]:
            rows.append(measure(name, model, data, batch, args.repeats))
            print(json.dumps(rows[-1]), flush=True)
    write(rows, run_meta(load_before, args.repeats), Path(args.output))


if __name__ == "__main__":
    main()
