"""torch_compile on the training passes: what compiling costs and what each pass gains.

One training pass = cppo's scoring pass with gradients (completion_logprobs forward + backward),
as the Learner runs it, on fixed micro-batches whose completion lengths differ (so the packed
token count changes from pass to pass, as in a run). For each model and path it measures, in
one process:

- eager: seconds per pass without compiling;
- compiled: seconds per pass after the first compiled pass (torch.compile, the given backend
  and mode, dynamic shapes), and the compile seconds (dynamo's own count);
- ratio eager / compiled, and the break-even: passes after which the compile time is paid back.

Paths: `lean` (cppo's lean forward: the per-layer work compiled, attention eager) and `model`
(the model's own transformers forward, compiled whole: LoRA, other architectures, gradient
checkpointing). Models: the shipped embedded model and a wider random Llama.

    python benchmarks/torch_compile.py            # both models, both paths, 1 thread
    python benchmarks/torch_compile.py --quick    # the embedded model only

Writes benchmarks/results/torch_compile/results.md and results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import subprocess
import sys

import torch

from common import machine, spread, write_results

OUT = Path(__file__).resolve().parent / "results" / "torch_compile"
WIDE = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=8, vocab_size=8192)


def load(name: str):
    """(model, label): the embedded model, or a random Llama of WIDE's sizes."""
    from cppo.models import load_model
    if name == "embedded":
        return load_model("embedded"), "embedded (1.05M parameters)"
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(max_position_embeddings=512, attn_implementation="sdpa",
                                         **WIDE))
    params = sum(p.numel() for p in model.parameters())
    return model, f"random Llama d={WIDE['hidden_size']}, {WIDE['num_hidden_layers']} layers, V={WIDE['vocab_size']} ({params / 1e6:.1f}M parameters)"


def batches(vocab: int, count: int, rows: int, prompt: int, completion: int) -> list[tuple]:
    """`count` micro-batches of `rows` completions (G = 8 per prompt), each with its own spread of
    completion lengths (1..completion): prompt ids, prompt mask, completion ids, completion mask."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        prompts = torch.randint(3, vocab, (rows // 8, prompt), generator=gen).repeat_interleave(8, 0)
        ids = torch.randint(3, vocab, (rows, completion), generator=gen)
        lengths = torch.randint(1, completion + 1, (rows,), generator=gen)
        mask = (torch.arange(completion)[None] < lengths[:, None]).long()
        out.append((prompts, torch.ones_like(prompts), ids, mask))
    return out


def one_pass(model, batch, *, lean: bool, settings) -> float:
    """Seconds of one training pass (forward + backward) on a micro-batch."""
    from cppo.sampling.logprobs import ForwardSettings, completion_logprobs
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    completion_logprobs(model, *batch, forward=ForwardSettings(lean=lean, compile=settings)).sum().backward()
    if batch[0].is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(name: str, path: str, args) -> dict:
    """Compile (the first compiled pass over each micro-batch), then eager and compiled passes
    interleaved, so that both see the same load on a shared machine."""
    from cppo.models.compiled import CompileSettings, compile_seconds
    model, label = load(name)
    model.to(args.device).train()
    data = [tuple(t.to(args.device) for t in batch)
            for batch in batches(model.config.vocab_size, 3, args.rows, args.prompt, args.completion)]
    lean, settings = path == "lean", CompileSettings(args.backend, args.mode)
    for batch in data:   # warm-up of the eager pass (allocator, oneDNN kernels)
        one_pass(model, batch, lean=lean, settings=None)
    torch._dynamo.reset()
    before, start = compile_seconds(), time.perf_counter()
    for batch in data:
        one_pass(model, batch, lean=lean, settings=settings)
    first_seconds, took = time.perf_counter() - start, compile_seconds() - before
    eager, compiled = [], []
    for _ in range(args.repeats):
        for batch in data:
            eager.append(one_pass(model, batch, lean=lean, settings=None))
            compiled.append(one_pass(model, batch, lean=lean, settings=settings))
    assert compile_seconds() - before == took, "recompiled during the timed passes"
    eager_s, compiled_s = statistics.median(eager), statistics.median(compiled)
    gain = eager_s - compiled_s
    row = {"model": label, "path": path, "eager_ms": 1e3 * eager_s, "compiled_ms": 1e3 * compiled_s,
           "ratio": eager_s / compiled_s,
           "pair_ratios": [e / c for e, c in zip(eager, compiled)],
           "compile_seconds": took, "first_round_seconds": first_seconds,
           "break_even_passes": (took / gain) if gain > 0 else None}
    print(f"{label:60s} {path:6s} eager {row['eager_ms']:8.1f} ms  compiled "
          f"{row['compiled_ms']:8.1f} ms  x{row['ratio']:.2f} (pairs {pairs(row)})"
          f"  compile {took:6.1f} s", file=sys.stderr, flush=True)
    return row


def pairs(row: dict) -> str:
    """'0.95 to 1.10': the range of a row's eager / compiled ratios, pass pair by pass pair."""
    ratios = spread(row["pair_ratios"])
    return f"{ratios['min']:.2f} to {ratios['max']:.2f}"


def pay_back(passes: float | None) -> str:
    return "never" if passes is None else f"{passes:,.0f}"


def table(rows: list[dict]) -> str:
    head = ("| model | path | eager ms/pass | compiled ms/pass | eager / compiled (pass pairs) | "
            "compile s (cold cache) | "
            "passes to pay back |\n|---|---|---|---|---|---|---|")
    lines = [f"| {r['model']} | {r['path']} | {r['eager_ms']:.1f} | {r['compiled_ms']:.1f} | "
             f"{r['ratio']:.2f}x ({pairs(r)}) | "
             f"{r['compile_seconds']:.1f} | "
             f"{pay_back(r['break_even_passes'])} |" for r in rows]
    return "\n".join([head, *lines])


def in_fresh_process(row: str) -> dict:
    """One measurement in its own process with an empty inductor cache, so that its compile
    seconds are a first run's (no kernels from another row, in memory or on disk)."""
    with tempfile.TemporaryDirectory(prefix="cppo-inductor-") as cache:
        out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--row", row],
                             env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache},
                             stdout=subprocess.PIPE, text=True, check=True).stdout
    line = next(line for line in out.splitlines() if line.startswith("ROW "))
    return json.loads(line[4:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the embedded model only")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--mode", default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, default=64, help="completions per micro-batch")
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--completion", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--output", type=Path, default=OUT)
    parser.add_argument("--row", help=argparse.SUPPRESS)   # MODEL:PATH, in a worker process
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.row:
        print("ROW " + json.dumps(measure(*args.row.split(":"), args)), flush=True)
        return
    m = machine(args.device)
    load_start = os.getloadavg()[0]
    models = ["embedded"] if args.quick else ["embedded", "wide"]
    rows = [in_fresh_process(f"{name}:{path}") for name in models for path in ("lean", "model")]
    command = "python benchmarks/torch_compile.py" + (" --quick" if args.quick else "") + (
        f" --device {args.device}" if args.device != "cpu" else "")
    result = {"command": command, "machine": m, "python": m["python"], "backend": args.backend,
              "mode": args.mode, "threads": args.threads,
              "micro_batch": {"rows": args.rows, "prompt": args.prompt, "completion": args.completion},
              "load_average": [load_start, os.getloadavg()[0]], "rows": rows}
    gpu = f" ({m['gpu']})" if "gpu" in m else ""
    write_results(args.output, result, f"""# torch_compile on the training passes

`{command}`

One training pass: completion_logprobs forward + backward on a micro-batch of {args.rows}
completions (8 per prompt, prompts of {args.prompt} tokens, completions of 1 to {args.completion}
tokens: the packed token count differs between the 3 micro-batches, as in a run). After one
compiled round (the compile), eager and compiled passes alternate, {args.repeats} x 3 pairs, so
both see the same load; medians, and the range of the pairs' ratios. Each row in a fresh
process with an empty inductor cache: its compile seconds are a first run's (a warm on-disk
cache, from an earlier run of the same code, cuts them several-fold). torch.compile
backend `{args.backend}`, mode `{args.mode or 'default'}`, dynamic shapes, on {args.device}{gpu}. Machine: {m['cpu']},
torch {m['torch']}, CPU capability (`torch.backends.cpu.get_cpu_capability()`)
**{m['cpu_capability']}**, {args.threads} thread(s); load average {load_start:.1f} at the
start, {result['load_average'][1]:.1f} at the end (shared machine: times are noisy).

{table(rows)}

"passes to pay back": compile seconds / (eager - compiled seconds per pass); a run pays for
compiling after that many training passes (each optimizer step runs one per micro-batch, plus
the old-policy and reference passes without gradients, which compile once more).
""", echo=False)
    print(f"wrote {args.output / 'results.md'}")


if __name__ == "__main__":
    main()
