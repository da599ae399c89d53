"""Speculative sampling (num_speculative_tokens): acceptance, tokens per forward and speed.

cppo's built-in sampler with its n-gram drafter (prompt and sibling completions) against plain
decoding, same prompts, G, length limit and temperature, on two models:

  embedded         the shipped 1M-parameter model on the embedded arithmetic task (its default
                   recipe: G = 8, 5 new tokens: a 4-digit answer and the end-of-sequence token)
  real_shape       benchmarks/real_shape.py's quick model (random Qwen2, 32k vocabulary, 4
                   layers), G = 8, 64 new tokens, temperature 1: text from random weights, the
                   drafter's worst case
  real_shape_cold  the same at temperature 0.3 with the end-of-sequence token disabled (at 0.3
                   the calibrated model would stop at once), where the random model repeats
                   itself: the drafter's best case (its drafts are right)

For each, k = num_speculative_tokens in --k (0 = plain sampling). Runs are interleaved over
--repeats, each with a fresh seed; seconds are reported as min / median / max (the machine is
shared with other work: ranges, not best runs). Acceptance rate = accepted / drafted tokens;
tokens per forward = tokens each completion gained per decode forward it took part in.

    python benchmarks/speculative.py                    # as benchmarks/results/speculative/ was made
    python benchmarks/speculative.py --quick

Writes benchmarks/results/speculative/results.md and results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cppo.sampling.sampler import Decoding, encode_prompts, sample_completions  # noqa: E402
from cppo.sampling.settings import SamplingSettings  # noqa: E402
from cppo.sampling.speculative import Speculation  # noqa: E402

from common import machine, spread, write_results  # noqa: E402


def embedded_setup(questions: int):
    from cppo.data import arithmetic
    from cppo.models import load_model, load_tokenizer
    model, tok = load_model("embedded").eval(), load_tokenizer("embedded")
    return model, tok, [p.prompt for p in arithmetic.generate(3, "train", questions, seed=0)]


def real_shape_setup(questions: int):
    import real_shape
    from cppo.models import load_model, load_tokenizer
    shape = {k: v for k, v in real_shape.QUICK.items() if k not in ("steps", "repeats")}
    folder = real_shape.build_assets(Path(tempfile.gettempdir()) / "cppo_real_shape_quick", shape)
    model, tok = load_model(str(folder)).eval(), load_tokenizer(str(folder))
    prompts = [r["prompt"] for r in json.loads((folder / "prompts.json").read_text())[:questions]]
    return model, tok, prompts


def measure(model, tok, prompts, *, group: int, max_new: int, ks: list[int], repeats: int,
            temperature: float, stop: bool = True) -> list[dict]:
    batch = encode_prompts(tok, prompts, 128)
    rows = {k: {"k": k, "seconds": [], "forwards": 0, "row_forwards": 0, "tokens": 0,
                "drafted": 0, "accepted": 0, "mean_length": []} for k in ks}

    def run(k: int, seed: int):
        start = time.perf_counter()
        out = sample_completions(model, batch, num_generations=group, max_new_tokens=max_new,
                                 eos_token_id=tok.eos_token_id if stop else -1,
                                 pad_token_id=tok.pad_token_id,
                                 sampling=SamplingSettings(temperature=temperature),
                                 generator=torch.Generator().manual_seed(seed),
                                 decoding=Decoding(speculative=Speculation(k) if k else None))
        return time.perf_counter() - start, out
    for k in ks:                                   # warm-up
        run(k, 10_000)
    for repeat in range(repeats):
        for k in ks:
            seconds, out = run(k, repeat)
            row = rows[k]
            row["seconds"].append(seconds)
            row["mean_length"].append(float(out.lengths.float().mean()))
            if out.speculation is not None:
                s = out.speculation
                for key in ("forwards", "row_forwards", "tokens", "drafted", "accepted"):
                    row[key] += getattr(s, key)
    results = []
    plain = statistics.median(rows[ks[0]]["seconds"]) if ks[0] == 0 else None
    for k in ks:
        r = rows[k]
        seconds = spread(r["seconds"])
        med = seconds["median"]
        results.append({
            "k": k, "seconds_min": seconds["min"], "seconds_median": med,
            "seconds_max": seconds["max"], "speedup_median": plain / med if plain else None,
            "acceptance_rate": r["accepted"] / r["drafted"] if r["drafted"] else None,
            "tokens_per_forward": r["tokens"] / r["row_forwards"] if r["row_forwards"] else 1.0,
            "drafts_per_row_forward": r["drafted"] / r["row_forwards"] if r["row_forwards"] else 0.0,
            "mean_length": statistics.mean(r["mean_length"])})
    return results


def write_report(result: dict, out: Path) -> None:
    m = result["machine"]
    lines = ["# Speculative sampling: n-gram drafts verified by the policy", "",
             f"`python benchmarks/speculative.py {result['argv']}`", "",
             f"Machine: {m['cpu']}, torch {m['torch']}, CPU capability **{m['cpu_capability']}**, "
             f"{result['threads']} thread(s); load average {result['load_average'][0]:.1f} at the "
             f"start, {result['load_average'][1]:.1f} at the end (the machine was shared with other "
             f"sessions: timings are noisy, read the ranges). {result['repeats']} interleaved repeats "
             f"per row, a fresh seed each.", ""]
    for case in result["cases"]:
        lines += [f"## {case['name']}: Q = {case['questions']}, G = {case['group']}, "
                  f"{case['max_new']} new tokens, temperature {case['temperature']}", "",
                  "| k | acceptance rate | drafts per row-forward | tokens per forward | "
                  "mean length | seconds min / median / max | speed-up (median) |",
                  "|---|---|---|---|---|---|---|"]
        for r in case["rows"]:
            acc = "–" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.1%}"
            speed = "1 (plain)" if r["k"] == 0 else f"{r['speedup_median']:.2f}x"
            lines.append(f"| {r['k']} | {acc} | {r['drafts_per_row_forward']:.2f} | "
                         f"{r['tokens_per_forward']:.2f} | {r['mean_length']:.1f} | "
                         f"{r['seconds_min']:.3f} / {r['seconds_median']:.3f} / {r['seconds_max']:.3f} | "
                         f"{speed} |")
        lines.append("")
    write_results(out, result, "\n".join(lines), indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, nargs="+", default=[0, 2, 4, 8])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--cases", nargs="+", default=["embedded", "real_shape", "real_shape_cold"])
    parser.add_argument("--output", default="benchmarks/results/speculative")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.k = 2, [0, 4]
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()[0]
    cases = []
    for name in args.cases:
        temperature = 0.3 if name.endswith("_cold") else args.temperature
        if name == "embedded":
            questions, group, max_new = 32, 8, 5
            model, tok, prompts = embedded_setup(questions)
        else:
            questions, group, max_new = 4, 8, 64
            model, tok, prompts = real_shape_setup(questions)
        print(f"{name}: Q={questions} G={group} T={max_new}", flush=True)
        rows = measure(model, tok, prompts, group=group, max_new=max_new, ks=args.k,
                       repeats=args.repeats, temperature=temperature, stop=not name.endswith("_cold"))
        cases.append({"name": name, "questions": questions, "group": group, "max_new": max_new,
                      "temperature": temperature, "rows": rows})
    result = {"argv": " ".join(sys.argv[1:]), "machine": machine(), "threads": args.threads,
              "repeats": args.repeats, "temperature": args.temperature,
              "load_average": [load_start, os.getloadavg()[0]], "cases": cases}
    write_report(result, Path(args.output))


if __name__ == "__main__":
    main()
