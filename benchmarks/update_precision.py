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
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import trainer_for  # noqa: E402
from sampling_precision import main_for, ms_fields  # noqa: E402
# per_device_train_batch_size (completions per update)
POINTS = {"embedded": [16, 64, 256, 512], "real_shape": [4, 16]}
NEW_TOKENS = {"embedded": 5, "real_shape": 32}
# results.md's text (sampling_precision.write_table)
REPORT = dict(
    title="Update precision",
    intro="One update (`trainer.update`: forward, backward and optimizer step over the kept "
          "completions), median of {repeats} alternating updates per dtype (range in brackets). "
          "`auto` runs the decoder's Linear matmuls in bfloat16 on a CPU when a micro-batch has at "
          "least {threshold:.0e} multiply-adds.",
    head="| model | completions per update | multiply-adds per micro-batch | float32 ms | "
         "bfloat16 matmuls ms | bf16 / f32 | auto picks |",
    size="batch", work="micro_batch_multiply_adds")


def length_reward(completions, **kwargs):
    """Varied rewards, so that every group has advantages to train on."""
    return [float(len(c) % 3) for c in completions]


def measure(name: str, model: str | None, rows, batch: int, repeats: int) -> dict:
    """One point (completions per update): float32 against bfloat16 matmuls, alternating."""
    from cppo.parallel import hardware
    from cppo.parallel.memory import ModelShape
    shape = (dict(num_generations=8, pruning_rate=0.75) if name == "embedded"
             else dict(num_generations=batch, pruning_rate=0.0, max_prompt_length=128))
    trainer = trainer_for(model, rows, length_reward if rows else None,
                          prefix="cppo_update_precision_", per_device_train_batch_size=batch,
                          max_completion_length=NEW_TOKENS[name], matmul_dtype=None, eval_steps=0,
                          save_steps=0, report_to=[], **shape)
    update, current = trainer.update, {"dtype": None}
    seconds = {None: [], "bfloat16": []}

    def timed_update(*args, **kwargs):   # the trainer's update(batch, round_tokens)
        start = time.perf_counter()
        out = update(*args, **kwargs)
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
    return {"model": name, "batch": batch, "micro_batch_multiply_adds": work,
            **ms_fields(seconds, {None: "float32", "bfloat16": "bfloat16"}, "bfloat16", None),
            "auto_picks": hardware.auto_matmul_dtype(trainer.policy.dtype, "cpu", True, work) or "float32"}


def main() -> None:
    main_for(__doc__, POINTS, "update_precision", measure, REPORT)


if __name__ == "__main__":
    main()
