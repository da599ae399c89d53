"""Peak memory of the scoring pass's head at a real vocabulary: full logits against chunks.

The last step of the scoring pass (forward and backward): hidden states (M, d) through the output
head (V, d) to each token's log-probability and entropy, with the gradient of their sum to the
hidden states and the head. `full` is what cppo's scoring pass did before (the (M, V) logits,
selective_log_softmax, the differentiable entropy); `chunked` is cppo.models.head (the scoring pass
takes it above logprobs.HEAD_CHUNK_ABOVE logits). Each variant runs in a fresh process; the
figure is the growth of the process's peak resident memory over what it held after allocating the
inputs and the head (ru_maxrss), so the head's weights, gradients and inputs are not counted.

    python benchmarks/chunked_head.py              # V = 151,936 (Qwen2), d = 896, M = 1,024
    python benchmarks/chunked_head.py --quick      # V = 32,768, M = 256

Writes benchmarks/results/chunked_head/results.md and results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from common import machine, write_results


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker(variant: str, vocab: int, hidden_size: int, tokens: int, threads: int) -> dict:
    import torch
    torch.set_num_threads(threads)
    from cppo.models.head import chunked_logprobs_and_entropy
    from cppo.sampling.logprobs import differentiable_entropy, selective_log_softmax
    torch.manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, requires_grad=True)
    weight = (torch.randn(vocab, hidden_size) * 0.02).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,))
    weight.grad = torch.zeros_like(weight)      # the gradient buffers exist in a training step too
    hidden.grad = torch.zeros_like(hidden)
    base = peak_mb()
    start = time.perf_counter()
    if variant == "full":
        logits = hidden @ weight.t()
        logp = selective_log_softmax(logits, targets)
        entropy = differentiable_entropy(logits)
    else:
        logp, entropy = chunked_logprobs_and_entropy(hidden, weight, None, targets)
    (logp.sum() + 0.01 * entropy.sum()).backward()
    seconds = time.perf_counter() - start
    return {"variant": variant, "peak_growth_mb": peak_mb() - base, "baseline_mb": base,
            "seconds": seconds, "logp_sum": float(logp.sum()), "entropy_sum": float(entropy.sum())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--output", default="benchmarks/results/chunked_head")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.vocab, args.tokens, args.repeats = 32_768, 256, 1
    if args.worker:
        print(json.dumps(worker(args.worker, args.vocab, args.hidden, args.tokens, args.threads)))
        return
    import torch
    from cppo.sampling.logprobs import HEAD_CHUNK_ABOVE
    from cppo.models.head import HEAD_CHUNK
    load_start = os.getloadavg()[0]
    runs = []
    for _ in range(args.repeats):
        for variant in ("full", "chunked"):
            cmd = [sys.executable, __file__, "--worker", variant, "--vocab", str(args.vocab),
                   "--hidden", str(args.hidden), "--tokens", str(args.tokens),
                   "--threads", str(args.threads)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            runs.append(json.loads(out.strip().splitlines()[-1]))
            print(runs[-1], flush=True)
    torch.set_num_threads(args.threads)
    result = {"argv": " ".join(sys.argv[1:]), "machine": machine(), "vocab": args.vocab,
              "hidden": args.hidden, "tokens": args.tokens, "threads": args.threads,
              "head_chunk": HEAD_CHUNK, "chunk_above_logits": HEAD_CHUNK_ABOVE,
              "load_average": [load_start, os.getloadavg()[0]], "runs": runs}
    m = result["machine"]
    logits_mb = args.tokens * args.vocab * 4 / 2**20
    lines = ["# The head at a real vocabulary: full logits against chunks", "",
             f"`python benchmarks/chunked_head.py {result['argv']}`", "",
             f"V = {args.vocab:,}, d = {args.hidden}, M = {args.tokens:,} tokens (one float32 "
             f"logits tensor: {logits_mb:,.0f} MiB); chunks of {HEAD_CHUNK} tokens. Machine: "
             f"{m['cpu']}, torch {m['torch']}, CPU capability **{m['cpu_capability']}**, "
             f"{args.threads} thread(s); load average {result['load_average'][0]:.1f} at the start, "
             f"{result['load_average'][1]:.1f} at the end (shared machine: seconds are noisy).", "",
             "Peak memory growth of a fresh process over its inputs, head and gradient buffers, "
             "for the forward and backward of log p + 0.01 x entropy:", "",
             "| variant | peak growth MiB (runs) | seconds (runs) |", "|---|---|---|"]
    for variant in ("full", "chunked"):
        rs = [r for r in runs if r["variant"] == variant]
        peaks = " / ".join(f"{r['peak_growth_mb']:,.0f}" for r in rs)
        seconds = " / ".join(f"{r['seconds']:.2f}" for r in rs)
        lines.append(f"| {variant} | {peaks} | {seconds} |")
    write_results(Path(args.output), result, lines, indent=1)


if __name__ == "__main__":
    main()
