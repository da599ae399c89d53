"""Rollout and scoring speed: cppo's sampler against transformers `generate(num_return_sequences=G)`,
and cppo's lean scoring pass against the model's own forward.

Rollouts: same model, prompts, G and length limit, temperature 1.0, for four samplers: the
KV-shared sampler on the model's own forward, the same on cppo's lean forward, the lean forward on
bfloat16 weights (generation_dtype), and transformers generate. Scoring: forward + backward of the
completions' log-probs (what an update step runs), the model's forward against the lean one
(each distinct prompt once). Repetitions are interleaved and medians reported, so every variant
sees the same machine load.

    python benchmarks/rollout.py                 # embedded model, Q in {16, 64, 128}, G = 16, medians of 5
    python benchmarks/rollout.py --repeats 7     # as benchmarks/results/rollout/ was made
    python benchmarks/rollout.py --quick
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from cppo.data import arithmetic
from cppo.models import load_model, load_tokenizer
from cppo.sampling.logprobs import ForwardSettings, completion_logprobs
from cppo.sampling.sampler import Decoding, encode_prompts, sample_completions

from common import machine, write_results


def time_once(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleaved(variants, repeats: int) -> list[float]:
    """Median seconds of each variant, runs interleaved (one warm-up run each)."""
    for run in variants:
        run()
    times = [[] for _ in variants]
    for _ in range(repeats):
        for run, bucket in zip(variants, times):
            bucket.append(time_once(run))
    return [statistics.median(t) for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--questions", type=int, nargs="+", default=[1, 16, 64, 128])
    parser.add_argument("--num_generations", type=int, default=16, help="G: completions per question")
    parser.add_argument("--max_new_tokens", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", default="benchmarks/results/rollout")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.questions, args.repeats = [16], 2

    model, tok = load_model(args.model).eval(), load_tokenizer(args.model)
    questions = max(args.questions + [128])   # the scoring table's largest row takes 128
    rows = [p.to_row() for p in arithmetic.generate(3, "train", n=questions, seed=0)]
    gen = torch.Generator().manual_seed(0)
    m = machine()
    lines = [f"Machine: {m['cpu']} ({m['machine']}), {m['cores']} CPU cores, torch {m['torch']}, "
             f"CPU capability **{m['cpu_capability']}**, AVX512-BF16 flag {m['avx512_bf16']}, "
             f"{torch.get_num_threads()} threads; model {args.model}; G = {args.num_generations}, "
             f"max_new_tokens = {args.max_new_tokens}; median of {args.repeats} interleaved runs.",
             "", "Rollouts (seconds; speed-up = transformers generate / row):", "",
             "| questions | completions | KV-shared, model forward | KV-shared, lean | lean, bf16 weights "
             "| transformers generate | speed-up (lean) | speed-up (lean bf16) |",
             "|---|---|---|---|---|---|---|---|"]
    results = []
    for q in args.questions:
        prompts = encode_prompts(tok, [r["prompt"] for r in rows[:q]])

        def sampler(lean, dtype=None):
            return lambda: sample_completions(
                model, prompts, num_generations=args.num_generations, max_new_tokens=args.max_new_tokens,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, generator=gen,
                decoding=Decoding(lean=lean, dtype=dtype))

        def theirs():
            with torch.no_grad():
                model.generate(input_ids=prompts.ids, attention_mask=prompts.mask, do_sample=True,
                               temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=args.num_generations,
                               max_new_tokens=args.max_new_tokens, eos_token_id=tok.eos_token_id,
                               pad_token_id=tok.pad_token_id)
        variants = [sampler(False), sampler(True), sampler(True, torch.bfloat16), theirs]
        times = interleaved(variants, args.repeats)
        results.append((q, *times))
        plain, lean, lean_bf16, hf = times
        lines.append(f"| {q} | {q * args.num_generations} | {plain:.3f} | {lean:.3f} | {lean_bf16:.3f} | {hf:.3f} "
                     f"| {hf / lean:.2f}x | {hf / lean_bf16:.2f}x |")
        print(lines[-1], flush=True)

    lines += ["", "Scoring pass, forward + backward of the completions' log-probs (seconds):", "",
              "| questions x completions kept | model forward | lean (distinct prompts once) | speed-up |",
              "|---|---|---|---|"]
    model.train()
    for q, per in ((1, 16), (8, 2), (16, 1), (128, 2)):
        prompts = encode_prompts(tok, [r["prompt"] for r in rows[:q] for _ in range(per)])
        ids = torch.randint(3, len(tok), (q * per, args.max_new_tokens), generator=gen)
        mask = torch.ones_like(ids)

        def scoring(lean):
            def run():
                model.zero_grad(set_to_none=True)
                completion_logprobs(model, prompts.ids, prompts.mask, ids, mask,
                                    forward=ForwardSettings(lean=lean)).sum().backward()
            return run
        plain, lean = interleaved([scoring(False), scoring(True)], args.repeats)
        lines.append(f"| {q} x {per} | {plain:.3f} | {lean:.3f} | {plain / lean:.2f}x |")
        print(lines[-1], flush=True)
    model.eval()

    out = Path(args.output)
    write_results(out, None, lines, echo=False)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r[0] * args.num_generations for r in results]
    for column, label in enumerate(("KV-shared, model forward", "KV-shared, lean forward",
                                    "lean forward, bf16 weights", "transformers generate"), start=1):
        ax.plot(xs, [r[column] for r in results], "o-", label=label)
    ax.set(xlabel="completions per batch", ylabel="seconds", title="Rollout time (lower is better)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "rollout.png", dpi=110)
    print("\n".join(lines))
    print(f"wrote {out / 'results.md'} and {out / 'rollout.png'}")


if __name__ == "__main__":
    main()
