"""When sampling from a bfloat16 copy pays on a CPU: one generation round, float32 against bf16.

For each model and decoding batch, two runs' parts (build_run) are made on the same model and questions,
one sampling with the float32 policy's own weights (`generation_dtype: none`) and one from a
bfloat16 copy (`generation_dtype: bfloat16`, the copy refreshed every round as in training); after
a warm-up round each, their rounds (the generation stage, `generation.sample`: prompts, decoding,
the copy) alternate,
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
from common import first_round_rows, machine, parts_for, spread, spread_text, write_results  # noqa: E402

# (questions per round, G): completions decoded together = questions x G
POINTS = {"embedded": [(1, 16), (4, 16), (16, 16), (24, 16), (32, 16), (64, 16), (128, 16)],
          "real_shape": [(1, 2), (1, 4), (1, 8), (1, 16)]}
NEW_TOKENS = {"embedded": 5, "real_shape": 16}
# results.md's text (write_table): {repeats} and {threshold} are filled in
REPORT = dict(
    title="Sampling precision",
    intro="One generation round (`generation.sample`, the run's generation stage), median of {repeats} alternating rounds per "
          "dtype (range in brackets). `auto` samples in bfloat16 on a CPU when a decode step has at "
          "least {threshold:.0e} multiply-adds.",
    head="| model | completions decoded together | multiply-adds per decode step | float32 ms | "
         "bfloat16 copy ms | bf16 / f32 | auto picks |",
    size="completions", work="decode_multiply_adds")


def no_reward(completions, **kwargs):
    return [0.0] * len(completions)


def measure(name: str, model: str | None, rows, point: tuple[int, int], repeats: int) -> dict:
    """One point (questions per round, G): float32 against bfloat16 sampling."""
    from cppo.parallel import hardware
    from cppo.parallel.memory import ModelShape
    questions, group = point
    runs = {dtype: parts_for(model, rows, no_reward if rows else None,
                             prefix="cppo_precision_", num_generations=group,
                             pruning_rate=0.0 if questions == 1 else 1 - 1 / questions,
                             per_device_train_batch_size=group,
                             max_completion_length=NEW_TOKENS[name], max_prompt_length=128,
                             generation_dtype=dtype)
                for dtype in (None, "bfloat16")}
    batch = {dtype: first_round_rows(parts) for dtype, parts in runs.items()}
    seconds = {dtype: [] for dtype in runs}
    for i in range(repeats + 1):                          # round 0 warms up
        for dtype, parts in runs.items():
            start = time.perf_counter()
            parts.generation.sample(batch[dtype], round_index=0)
            if i:
                seconds[dtype].append(time.perf_counter() - start)
    policy = runs[None].models.policy
    work = questions * group * ModelShape.from_config(policy.config).multiply_adds_per_token()
    return {"model": name, "completions": questions * group, "decode_multiply_adds": work,
            **ms_fields(seconds, {None: "float32", "bfloat16": "bfloat16"}, "bfloat16", None),
            "auto_picks": hardware.auto_generation_dtype(policy.dtype, "cpu", True, work) or "float32"}


def ms_fields(seconds: dict, names: dict, over, under) -> dict:
    """A row's timings: for each setting of `seconds` (setting: its repeats' seconds), "<name>_ms"
    (the median) and "<name>_range_ms" in ms to 0.1 (names: setting -> name), and "ratio", the
    median of setting `over` over that of setting `under`."""
    out = {}
    for setting, name in names.items():
        ms = spread(seconds[setting], 1000, 1)
        out.update({f"{name}_ms": ms["median"], f"{name}_range_ms": [ms["min"], ms["max"]]})
    out["ratio"] = round(statistics.median(seconds[over]) / statistics.median(seconds[under]), 2)
    return out


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
    return {"argv": " ".join(sys.argv[1:]), "machine": machine(), "repeats": repeats,
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


def write_table(rows: list[dict], meta: dict, out: Path, program: str, title: str, intro: str,
                head: str, size: str, work: str) -> None:
    """results.json and results.md of a precision benchmark: `title` and the command, the machine,
    `intro`, then the table under `head`, a line per row: its model, rows[size], rows[work], the
    float32 and bfloat16 medians with ranges, the ratio and what auto picks."""
    from cppo.parallel.hardware import BF16_MIN_DECODE_MULTIPLY_ADDS
    lines = header_lines(f"{title} on a CPU (`python benchmarks/{program}.py {meta['argv']}`)", meta)
    lines += [intro.format(repeats=meta["repeats"], threshold=BF16_MIN_DECODE_MULTIPLY_ADDS), "",
              head, "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r[size]} | {r[work]:.2e} | "
              f"{spread_text(r['float32_ms'], *r['float32_range_ms'], brackets='[]')} | "
              f"{spread_text(r['bfloat16_ms'], *r['bfloat16_range_ms'], brackets='[]')} | "
              f"{r['ratio']:.2f}x | {r['auto_picks']} |" for r in rows]
    write_results(out, {"meta": meta, "rows": rows}, lines)


def main_for(doc: str, points: dict, program: str, measure, report: dict) -> None:
    """The run both precision benchmarks make: measure(name, model, rows, point, repeats) at each
    point of each model asked for, then write_table(..., **report)."""
    args = arguments(doc, points, program)
    load_before = os.getloadavg()[0]
    rows = []
    for name in args.models:
        model, data = real_shape_inputs(args.assets) if name == "real_shape" else (None, None)
        for point in points[name]:
            rows.append(measure(name, model, data, point, args.repeats))
            print(json.dumps(rows[-1]), flush=True)
    write_table(rows, run_meta(load_before, args.repeats), Path(args.output), program, **report)


def main() -> None:
    main_for(__doc__, POINTS, "sampling_precision", measure, REPORT)


if __name__ == "__main__":
    main()
