"""When sampling from a bfloat16 copy pays on a CPU: one generation round, float32 against bf16.

For each model and decoding batch, two CPPOTrainers are built on the same model and questions,
one sampling with the float32 policy's own weights (`generation_dtype: none`) and one from a
bfloat16 copy (`generation_dtype: bfloat16`, the copy refreshed every round as in training); after
a warm-up round each, their rounds (`trainer.generate`: prompts, decoding, the copy) alternate,
--repeats times, and the medians are compared. Each point is also given the multiply-adds of one
decode step (completions decoded together x the linear layers' multiply-adds per token,
`ModelShape.multiply_adds_per_token`) and what `generation_dtype: auto` picks there
(`hardware.auto_generation_dtype`, whose CPU threshold BF16_MIN_DECODE_MULTIPLY_ADDS these rows
are the evidence for).

Models: `embedded` (the shipped tiny Llama and task, G = 16, 5 new tokens) and `real_shape`
(benchmarks/real_shape.py's random 0.12B Qwen2, 32k vocabulary, one question, 16 new tokens).

    python benchmarks/sampling_precision.py
    python benchmarks/sampling_precision.py --models embedded --repeats 20

Writes benchmarks/results/sampling_precision/results.md and results.json.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
# (questions per round, G): completions decoded together = questions x G
POINTS = {"embedded": [(1, 16), (4, 16), (16, 16), (24, 16), (32, 16), (64, 16), (128, 16)],
          "real_shape": [(1, 2), (1, 4), (1, 8), (1, 16)]}
NEW_TOKENS = {"embedded": 5, "real_shape": 16}


def no_reward(completions, **kwargs):
    return [0.0] * len(completions)


def trainer_for(model: str | None, rows: list[dict] | None, questions: int, group: int,
                new_tokens: int, dtype: str | None):
    from cppo.config import CPPOConfig
    from cppo.trainer import CPPOTrainer
    cfg = CPPOConfig(output_dir=tempfile.mkdtemp(prefix="cppo_precision_"), num_generations=group,
                     pruning_rate=0.0 if questions == 1 else 1 - 1 / questions,
                     per_device_train_batch_size=group, max_completion_length=new_tokens,
                     max_prompt_length=128, generation_dtype=dtype, progress_bar=False,
                     **({"model": model} if model else {}))
    with contextlib.redirect_stdout(io.StringIO()):
        if model is None:
            return CPPOTrainer(args=cfg)
        return CPPOTrainer(args=cfg, train_dataset=rows, reward_funcs=[no_reward])


def measure(name: str, model: str | None, rows, questions: int, group: int, repeats: int) -> dict:
    from cppo.parallel import hardware
    from cppo.parallel.memory import ModelShape
    trainers = {dtype: trainer_for(model, rows, questions, group, NEW_TOKENS[name], dtype)
                for dtype in (None, "bfloat16")}
    batch = {dtype: t.take_questions()[0] for dtype, t in trainers.items()}
    seconds = {dtype: [] for dtype in trainers}
    for i in range(repeats + 1):                          # round 0 warms up
        for dtype, trainer in trainers.items():
            start = time.perf_counter()
            trainer.generate(batch[dtype])
            if i:
                seconds[dtype].append(time.perf_counter() - start)
    policy = trainers[None].policy
    work = questions * group * ModelShape.from_config(policy.config).multiply_adds_per_token()
    f32, bf16 = (statistics.median(seconds[d]) for d in (None, "bfloat16"))
    return {"model": name, "completions": questions * group, "decode_multiply_adds": work,
            "float32_ms": round(1000 * f32, 1), "bfloat16_ms": round(1000 * bf16, 1),
            "ratio": round(bf16 / f32, 2),
            "float32_range_ms": [round(1000 * min(seconds[None]), 1), round(1000 * max(seconds[None]), 1)],
            "bfloat16_range_ms": [round(1000 * min(seconds["bfloat16"]), 1),
                                  round(1000 * max(seconds["bfloat16"]), 1)],
            "auto_picks": hardware.auto_generation_dtype(policy.dtype, "cpu", True, work) or "float32"}


def header_lines(title: str, meta: dict) -> list[str]:
    """results.md's title and machine line (meta: machine, load_before, load_after)."""
    m = meta["machine"]
    return [f"# {title}", "",
            f"CPU: {m['cpu']}, torch {m['torch']}, CPU capability **{m['cpu_capability']}**, "
            f"AVX512-BF16: {m['avx512_bf16']}, AMX-BF16: {m['amx_bf16']}, fast bf16 as torch runs "
            f"here: {m['fast_bfloat16']}; {m['threads']} threads; 1-minute load average "
            f"{meta['load_before']} before, {meta['load_after']} after.", ""]


def real_shape_inputs(assets: str | None) -> tuple[str, list[dict]]:
    """benchmarks/real_shape.py's random 0.12B Qwen2 (built in `assets`, or a temporary folder)
    and 64 prompts for it."""
    from real_shape import FULL, build_assets, words
    folder = Path(assets or tempfile.mkdtemp(prefix="cppo_precision_assets_")) / "full"
    rng = random.Random(0)
    return str(build_assets(folder, dict(FULL))), [
        {"prompt": "Repeat shortly: " + " ".join(words(rng, FULL["prompt_words"])) + "\n"}
        for _ in range(64)]


def run_meta(load_before: float, repeats: int) -> dict:
    import torch
    from cppo.parallel import hardware
    return {"argv": " ".join(sys.argv[1:]), "machine": hardware.describe(), "repeats": repeats,
            "torch_threads": torch.get_num_threads(), "load_before": round(load_before, 2),
            "load_after": round(os.getloadavg()[0], 2)}


def arguments(doc: str, points: dict, output: str) -> argparse.Namespace:
    """The command line both precision benchmarks take."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(points), choices=list(points))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--assets", default=None, help="folder for the real-shape model (kept between runs)")
    parser.add_argument("--output", default=str(HERE / "results" / output))
    return parser.parse_args()


def write_results(lines: list[str], rows: list[dict], size: str, work: str, meta: dict, out: Path) -> None:
    """results.md (lines, then one table line per row: its model, rows[size], rows[work], the
    float32 and bfloat16 medians with ranges, the ratio and what auto picks) and results.json."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    for r in rows:
        lines.append(f"| {r['model']} | {r[size]} | {r[work]:.2e} | "
                     f"{r['float32_ms']} [{r['float32_range_ms'][0]}-{r['float32_range_ms'][1]}] | "
                     f"{r['bfloat16_ms']} [{r['bfloat16_range_ms'][0]}-{r['bfloat16_range_ms'][1]}] | "
                     f"{r['ratio']:.2f}x | {r['auto_picks']} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def write(rows: list[dict], meta: dict, out: Path) -> None:
    from cppo.parallel.hardware import BF16_MIN_DECODE_MULTIPLY_ADDS
    lines = header_lines(f"Sampling precision on a CPU (`python benchmarks/sampling_precision.py "
                         f"{meta['argv']}`)", meta) + [
             f"One generation round (`trainer.generate`), median of {meta['repeats']} alternating "
             f"rounds per dtype (range in brackets). `auto` samples in bfloat16 on a CPU when a "
             f"decode step has at least {BF16_MIN_DECODE_MULTIPLY_ADDS:.0e} multiply-adds.", "",
             "| model | completions decoded together | multiply-adds per decode step | float32 ms | "
             "bfloat16 copy ms | bf16 / f32 | auto picks |", "|---|---|---|---|---|---|---|"]
    write_results(lines, rows, "completions", "decode_multiply_adds", meta, out)


def main() -> None:
    args = arguments(__doc__, POINTS, "sampling_precision")
    load_before = os.getloadavg()[0]
    rows = []
    for name in args.models:
        model, data = real_shape_inputs(args.assets) if name == "real_shape" else (None, None)
        for questions, group in POINTS[name]:
            rows.append(measure(name, model, data, questions, group, args.repeats))
            print(json.dumps(rows[-1]), flush=True)
    write(rows, run_meta(load_before, args.repeats), Path(args.output))


if __name__ == "__main__":
    main()
