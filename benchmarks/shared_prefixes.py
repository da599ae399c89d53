"""Decoding identical completions once (`share_prefixes`): decode rows and generation time per round.

For each model, two runs' parts (build_run) on the same model and questions, one with
`share_prefixes: true` (the default) and one with `false`, run generation rounds (the generation
stage, `generation.sample`: prompts, the bfloat16 copy where `generation_dtype: auto` picks it, decoding) alternately after a warm-up
round each; reported: the rows the decode steps ran per round (the sequences of each forward,
summed over the steps) against the completions' decode rows, and the median round time with its
range. The completions are drawn from the same distribution either way (tests/test_rollout.py);
only the work differs.

Models: `embedded` (the shipped base model on the default recipe's round: 128 questions x G = 8,
5 new tokens), `trained` (the same round on a trained checkpoint, --trained RUN/checkpoint-600:
its completions agree more) and `real_shape` (benchmarks/real_shape.py's random 0.12B Qwen2,
32k vocabulary, 2 questions x G = 16, 32 new tokens at temperature 1: random weights, so the
completions differ from the first token and nothing is shared).

    python benchmarks/shared_prefixes.py --trained RUN/checkpoint-600

Writes benchmarks/results/shared_prefixes/results.md and results.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import first_round_rows, parts_for, spread_text, write_results  # noqa: E402
from sampling_precision import header_lines, ms_fields, real_shape_inputs, run_meta  # noqa: E402
ROUNDS = {"embedded": dict(questions=128, group=8, new_tokens=5),
          "trained": dict(questions=128, group=8, new_tokens=5),
          "real_shape": dict(questions=2, group=16, new_tokens=32)}


def no_reward(completions, **kwargs):
    return [0.0] * len(completions)


@contextlib.contextmanager
def counted_decode_rows(counter: list):
    """Add the sequences of every decode step the sampler runs to counter[0]."""
    from cppo.sampling import sampler
    original = sampler._decode

    def spy(logits, advance, *args, **kwargs):
        def counted(tokens, rows):
            counter[0] += len(tokens)
            return advance(tokens, rows)
        return original(logits, counted, *args, **kwargs)
    sampler._decode = spy
    try:
        yield
    finally:
        sampler._decode = original


def measure(name: str, model: str | None, rows, repeats: int) -> dict:
    shape = ROUNDS[name]
    runs = {share: parts_for(model, rows, no_reward if rows else None,
                             prefix="cppo_shared_prefixes_", num_generations=shape["group"],
                             per_device_train_batch_size=shape["questions"] * shape["group"] // 4,
                             pruning_rate=0.75, max_completion_length=shape["new_tokens"],
                             max_prompt_length=128, share_prefixes=share)
                for share in (True, False)}
    questions = first_round_rows(runs[True])[:shape["questions"]]
    seconds = {share: [] for share in runs}
    decode_rows = {share: [] for share in runs}
    completion_rows = []
    for i in range(repeats + 1):                          # round 0 warms up
        for share, parts in runs.items():
            counter = [0]
            with counted_decode_rows(counter):
                start = time.perf_counter()
                _, completions = parts.generation.sample(questions, round_index=0)
                took = time.perf_counter() - start
            if i:
                seconds[share].append(took)
                decode_rows[share].append(counter[0])
                if share:   # rows that needed a forward: every token but a completion's last
                    completion_rows.append(int((completions.lengths - 1).clamp(min=0).sum()))
    rows_shared, rows_plain = (statistics.mean(decode_rows[s]) for s in (True, False))
    return {"model": name, "completions": shape["questions"] * shape["group"],
            "new_tokens": shape["new_tokens"],
            "generation_dtype": runs[True].generation_dtype,
            "completion_decode_rows": round(statistics.mean(completion_rows)),
            "decode_rows_shared": round(rows_shared), "decode_rows_plain": round(rows_plain),
            "rows_saved": round(1 - rows_shared / rows_plain, 3),
            **ms_fields(seconds, {True: "shared", False: "plain"}, True, False)}


def write(rows: list[dict], meta: dict, out: Path) -> None:
    lines = header_lines(f"Shared prefixes in the sampler (`python benchmarks/shared_prefixes.py "
                         f"{meta['argv']}`)", meta) + [
        f"One generation round (`generation.sample`, the run's generation stage), median of {meta['repeats']} alternating "
        "rounds per setting (range in brackets). Decode rows: the sequences the decode steps ran, "
        "summed over the round's steps (plain sampling: the completions still being written, "
        "give or take the finished ones that have not yet left the batch).", "",
        "| model | completions x new tokens | sampling dtype | decode rows: shared / plain | rows "
        "saved | shared ms | plain ms | shared / plain |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['completions']} x {r['new_tokens']} | "
                     f"{r['generation_dtype'] or 'float32'} | {r['decode_rows_shared']} / "
                     f"{r['decode_rows_plain']} | {100 * r['rows_saved']:.0f} % | "
                     f"{spread_text(r['shared_ms'], *r['shared_range_ms'], brackets='[]')} | "
                     f"{spread_text(r['plain_ms'], *r['plain_range_ms'], brackets='[]')} | "
                     f"{r['ratio']:.2f}x |")
    write_results(out, {"meta": meta, "rows": rows}, lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(ROUNDS), choices=list(ROUNDS))
    parser.add_argument("--trained", default=None,
                        help="a trained checkpoint of the embedded default (RUN/checkpoint-600)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--assets", default=None, help="folder for the real-shape model (kept between runs)")
    parser.add_argument("--output", default=str(HERE / "results" / "shared_prefixes"))
    args = parser.parse_args()
    if "trained" in args.models and not args.trained:
        parser.error("the 'trained' row needs --trained RUN/checkpoint-600 (a run of `cppo train`), "
                     "or leave it out with --models embedded real_shape")
    load_before = os.getloadavg()[0]
    rows = []
    for name in args.models:
        model, data = {"embedded": (None, None), "trained": (args.trained, None)}.get(name) or \
            real_shape_inputs(args.assets)
        rows.append(measure(name, model, data, args.repeats))
        print(json.dumps(rows[-1]), flush=True)
    write(rows, run_meta(load_before, args.repeats), Path(args.output))


if __name__ == "__main__":
    main()
