"""The cost of drawing one token per completion (and its log-prob) at a decode step, by vocabulary.

Two ways of going from the head's logits (rows x vocabulary) to a token and its log-prob under
the sampling distribution, alternating, --repeats times, medians and ranges compared:

- whole row: what cppo's sampler did before (written out below): a float32 copy of the logits,
  softmax, a cumulative sum over the whole row, a binary search, and log_softmax for the log-prob;
  each a new row-sized tensor;
- now: `cppo.sampling.logits.sample_logits` with a buffer reused from step to step, as the
  sampler calls it: exp(logits - max) in that buffer, the row inverted block first, then token,
  and log p = log(weight) - log(sum of the weights).

The logits come as the bfloat16 sampling copy produces them (bfloat16) and as a float32 policy
does. Vocabularies: the embedded model's 18, real_shape's 32,768 and Qwen2.5's 151,936.

    python benchmarks/sampling_step.py
    python benchmarks/sampling_step.py --rows 128 --repeats 30

Writes benchmarks/results/sampling_step/results.md and results.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from common import machine, spread, spread_text, write_results

VOCABULARIES = (18, 32_768, 151_936)


def whole_row_draw(logits, generator):
    """The previous release's draw: float copy, softmax, cumsum over the row, log_softmax."""
    import torch
    logits = logits.float()
    cdf = logits.softmax(-1).cumsum(-1)
    u = torch.rand(logits.shape[0], 1, generator=generator) * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, u, right=True).squeeze(-1)
    return tokens, torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=128, help="completions decoded together")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", default="benchmarks/results/sampling_step")
    args = parser.parse_args()
    import torch
    from cppo.sampling.logits import sample_logits
    torch.set_num_threads(args.threads)
    m = machine()
    rows = []
    for vocab in VOCABULARIES:
        for dtype in (torch.bfloat16, torch.float32):
            logits = (torch.randn(args.rows, vocab, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
            buffer = torch.empty(args.rows, vocab)
            ways = {"whole row": lambda g: whole_row_draw(logits, g),
                    "now": lambda g: sample_logits(logits, g, out=buffer)}
            times = {name: [] for name in ways}
            for repeat in range(args.repeats + 1):
                for name, draw in ways.items():
                    start = time.perf_counter()
                    draw(torch.Generator().manual_seed(repeat))
                    if repeat:   # the first is a warm-up
                        times[name].append(time.perf_counter() - start)
            before, now = (statistics.median(times[n]) for n in ways)
            ms = {name: spread(times[name], 1e3, 3) for name in ways}
            rows.append({"vocabulary": vocab, "logits dtype": str(dtype).removeprefix("torch."),
                         "whole row ms": ms["whole row"]["median"],
                         "whole row range": [ms["whole row"]["min"], ms["whole row"]["max"]],
                         "now ms": ms["now"]["median"], "now range": [ms["now"]["min"], ms["now"]["max"]],
                         "speed-up": round(before / now, 2)})
            print(rows[-1], flush=True)
    result = {"machine": m, "rows": args.rows, "repeats": args.repeats, "threads": args.threads,
              "load_average": os.getloadavg()[0], "results": rows}
    lines = ["# Drawing one token per completion at a decode step", "",
             f"Command: `python benchmarks/sampling_step.py --rows {args.rows} --repeats {args.repeats}`  ",
             f"Machine: {m['cpu']}, torch {m['torch']}, CPU capability "
             f"**{m['cpu_capability']}**, AVX512-BF16 flag {m['avx512_bf16']}, "
             f"{args.threads} threads; 1-minute load average at the end {result['load_average']:.1f}.  ",
             f"{args.rows} completions; milliseconds per step, median (min-max) of {args.repeats} "
             f"alternating repeats.", "",
             "| vocabulary | logits | whole row (before) | now | speed-up |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['vocabulary']:,} | {r['logits dtype']} | "
                     f"{spread_text(r['whole row ms'], *r['whole row range'])} | "
                     f"{spread_text(r['now ms'], *r['now range'])} | {r['speed-up']}x |")
    write_results(args.output, result, lines, indent=1)


if __name__ == "__main__":
    main()
