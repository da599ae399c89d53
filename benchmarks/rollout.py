"""Rollout speed: cppo's KV-shared sampler against transformers `generate(num_return_sequences=G)`.

Same model, same prompts, same G and length limit, sampling at temperature 1.0; repetitions are
interleaved (ours, theirs, ours, ...) and medians reported, so both see the same machine load.

    python benchmarks/rollout.py                 # embedded model, Q in {16, 64, 128}, G = 16
    python benchmarks/rollout.py --quick
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from cppo.data import arithmetic
from cppo.models import load_model, load_tokenizer
from cppo.rollout import encode_prompts, sample_completions


def time_once(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--questions", type=int, nargs="+", default=[16, 64, 128])
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--max_new_tokens", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", default="benchmarks/results/rollout")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.questions, args.repeats = [16], 2

    model, tok = load_model(args.model).eval(), load_tokenizer(args.model)
    rows = [p.to_row() for p in arithmetic.generate(3, "train", n=max(args.questions), seed=0)]
    gen = torch.Generator().manual_seed(0)
    lines = [f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, "
             f"{torch.get_num_threads()} threads; model {args.model}; G = {args.group}, "
             f"max_new_tokens = {args.max_new_tokens}; median of {args.repeats} interleaved runs.",
             "", "| questions | completions | cppo sampler (s) | transformers generate (s) | speed-up |",
             "|---|---|---|---|---|"]
    results = []
    for q in args.questions:
        prompts = encode_prompts(tok, [r["prompt"] for r in rows[:q]])

        def ours():
            sample_completions(model, prompts, num_generations=args.group,
                               max_new_tokens=args.max_new_tokens, eos_token_id=tok.eos_token_id,
                               pad_token_id=tok.pad_token_id, generator=gen)

        def theirs():
            with torch.no_grad():
                model.generate(input_ids=prompts.ids, attention_mask=prompts.mask, do_sample=True,
                               temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=args.group,
                               max_new_tokens=args.max_new_tokens, eos_token_id=tok.eos_token_id,
                               pad_token_id=tok.pad_token_id)
        ours(), theirs()  # warm-up
        a, b = [], []
        for _ in range(args.repeats):
            a.append(time_once(ours))
            b.append(time_once(theirs))
        ta, tb = statistics.median(a), statistics.median(b)
        results.append((q, ta, tb))
        lines.append(f"| {q} | {q * args.group} | {ta:.3f} | {tb:.3f} | {tb / ta:.2f}x |")
        print(lines[-1], flush=True)

    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text("\n".join(lines) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r[0] * args.group for r in results]
    ax.plot(xs, [r[1] for r in results], "o-", label="cppo KV-shared sampler")
    ax.plot(xs, [r[2] for r in results], "s-", label="transformers generate")
    ax.set(xlabel="completions per batch", ylabel="seconds", title="Rollout time (lower is better)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "rollout.png", dpi=110)
    print("\n".join(lines))
    print(f"wrote {out / 'results.md'} and {out / 'rollout.png'}")


if __name__ == "__main__":
    main()
