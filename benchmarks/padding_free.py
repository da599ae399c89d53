"""Padding-free log-prob passes against the padded layout, on the real-shape quick model.

The model, tokenizer and prompts are those of benchmarks/real_shape.py --quick (a random Qwen2
with a 32,768-token vocabulary and a calibrated EOS, so sampled completions stop at varied
lengths). Completions are sampled from it (G per question); the passes then run as the trainer
runs them: the no-grad pass (old policy / reference) over the batch in micro-batches of G rows
trimmed to the batch's longest completion, and the grad pass (policy update: forward + backward)
per micro-batch trimmed to its own longest completion. Each is timed with
`completion_logprobs(..., packed=True)` (the default) and `packed=False` (padded layout),
interleaved, alternating the order per repeat; medians and ranges are reported, with the tokens
the projections and the head receive (counted, not computed from a formula) and the padding share.

A second table answers whether one pass per sequence (the model forward on [prompt, completion]
rows) beats the shared-prompt path when every prompt is distinct (one completion per prompt).

    python benchmarks/padding_free.py [--questions 2] [--repeats 7] [--shared]

Writes benchmarks/results/padding_free/results.md and results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, spread, spread_text, write_results  # noqa: E402
from real_shape import QUICK, build_assets  # noqa: E402

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402


class MatmulRows(TorchDispatchMode):
    """Rows of every mm / addmm, by output width (the qkv projection's and the head's)."""

    def __init__(self, widths: dict[str, int]):
        super().__init__()
        self.by_width = {w: name for name, w in widths.items()}
        self.rows = {name: 0 for name in widths}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default) \
                and out.shape[1] in self.by_width:
            self.rows[self.by_width[out.shape[1]]] += out.shape[0]
        return out


def trimmed(prompt_ids, prompt_mask, ids, mask):
    width = max(1, int(mask.sum(1).max()))
    return prompt_ids, prompt_mask, ids[:, :width], mask[:, :width]


def micro_batches(batch, rows: int):
    prompt_ids, prompt_mask, ids, mask = batch
    return [trimmed(prompt_ids[s:s + rows], prompt_mask[s:s + rows], ids[s:s + rows], mask[s:s + rows])
            for s in range(0, len(ids), rows)]


def nograd_pass(model, batch, rows, packed: bool):
    with torch.no_grad():
        completion_logprobs(model, *batch, forward=ForwardSettings(batch_size=rows, packed=packed))


def grad_pass(model, batch, rows, packed: bool):
    for micro in micro_batches(batch, rows):
        logps = completion_logprobs(model, *micro, forward=ForwardSettings(packed=packed))
        (logps * micro[3]).sum().backward()
    model.zero_grad(set_to_none=True)


def per_sequence(model, batch, rows, grad: bool):
    """One lean forward per [prompt, completion] row (the lean path before the shared-prompt
    path served every case), micro-batches of `rows`."""
    from cppo.models.lean import lean_forward_for
    from cppo.sampling.logprobs import selective_log_softmax
    lean = lean_forward_for(model)[0]
    with torch.set_grad_enabled(grad):
        for prompt_ids, prompt_mask, ids, mask in micro_batches(batch, rows):
            full = torch.cat([prompt_ids, ids], 1)
            full_mask = torch.cat([prompt_mask, mask], 1)
            positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
            logits = lean(full, positions, full_mask.bool(), logits_to_keep=ids.shape[1] + 1)[0][:, :-1]
            logps = selective_log_softmax(logits, ids)
            if grad:
                (logps * mask).sum().backward()
    model.zero_grad(set_to_none=True)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleave(variants: dict, repeats: int) -> dict[str, list[float]]:
    """Seconds per repeat of each variant; the order alternates between repeats; one warm-up."""
    names = list(variants)
    for name in names:
        variants[name]()
    times = {name: [] for name in names}
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            times[name].append(timed(variants[name]))
    return times


def stats(seconds: list[float]) -> dict:
    return {**spread(seconds), "runs": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shared", action="store_true", help="record that other work shared the machine")
    parser.add_argument("--assets", default=None, help="model folder (default: real_shape's quick cache)")
    parser.add_argument("--output", default="benchmarks/results/padding_free")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    global completion_logprobs, ForwardSettings
    from cppo.models import load_model, load_tokenizer
    from cppo.sampling.logprobs import ForwardSettings, completion_logprobs
    from cppo.sampling.sampler import encode_prompts, sample_completions
    load_start = os.getloadavg()[0]
    shape = {k: v for k, v in QUICK.items() if k not in ("steps", "repeats")}
    folder = build_assets(Path(args.assets or Path(tempfile.gettempdir()) / "cppo_real_shape_quick"), shape)
    model, tok = load_model(str(folder)), load_tokenizer(str(folder))
    model.train()
    rows = [r["prompt"] for r in json.loads((folder / "prompts.json").read_text())]
    G = shape["group"]
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    widths = {"qkv": (config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim,
              "head": config.vocab_size}

    def sample(prompts: list[str], per_prompt: int):
        encoded = encode_prompts(tok, prompts, max_prompt_length=128)
        out = sample_completions(model, encoded, num_generations=per_prompt, max_new_tokens=shape["max_new"],
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                 generator=torch.Generator().manual_seed(args.seed))
        question = torch.arange(len(prompts)).repeat_interleave(per_prompt)
        return trimmed(encoded.ids[question], encoded.mask[question], out.ids, out.mask)

    def counted(fn) -> dict:
        with MatmulRows(widths) as mode:
            fn()
        layers = config.num_hidden_layers
        return {"token_rows": mode.rows["qkv"] // layers, "head_rows": mode.rows["head"]}

    def measure(batch, variants: dict, count: dict) -> dict:
        prompt_ids, prompt_mask, ids, mask = batch
        real_rows = int(prompt_mask.sum() + mask.sum())
        layout = len(ids) * (prompt_ids.shape[1] + ids.shape[1])
        times = interleave(variants, args.repeats)
        out = {"rows": len(ids), "prompt_width": prompt_ids.shape[1], "completion_width": ids.shape[1],
               "completion_lengths": mask.sum(1).tolist(),
               "padding_of_rows": 1 - real_rows / layout, "variants": {}}
        for name, fn in variants.items():
            out["variants"][name] = {**stats(times[name]), **(counted(count[name]) if name in count else {})}
        return out

    results = {}
    shared = sample(rows[:args.questions], G)
    kinds = {"no-grad pass (old policy / reference)": lambda packed: lambda: nograd_pass(model, shared, G, packed=packed),
             "grad pass (forward + backward)": lambda packed: lambda: grad_pass(model, shared, G, packed=packed)}
    for kind, make in kinds.items():
        print(f"shared prompts: {kind}", flush=True)
        variants = {"packed": make(True), "padded": make(False)}
        count = {"packed": lambda: nograd_pass(model, shared, G, packed=True),
                 "padded": lambda: nograd_pass(model, shared, G, packed=False)}
        results[f"shared: {kind}"] = measure(shared, variants, count)

    distinct = sample(rows[args.questions:args.questions + 2 * G], 1)
    for grad, kind in ((False, "no-grad pass"), (True, "grad pass")):
        print(f"distinct prompts: {kind}", flush=True)
        run = grad_pass if grad else nograd_pass
        variants = {"packed": lambda run=run: run(model, distinct, G, packed=True),
                    "padded": lambda run=run: run(model, distinct, G, packed=False),
                    "per-sequence": lambda grad=grad: per_sequence(model, distinct, G, grad)}
        count = {"packed": lambda: nograd_pass(model, distinct, G, packed=True),
                 "padded": lambda: nograd_pass(model, distinct, G, packed=False),
                 "per-sequence": lambda: per_sequence(model, distinct, G, False)}
        results[f"distinct: {kind}"] = measure(distinct, variants, count)

    result = {"argv": " ".join(sys.argv[1:]), "threads": args.threads, "shared_machine": args.shared,
              "machine": machine(), "load_average": [load_start, os.getloadavg()[0]],
              "shape": shape, "parameters": sum(p.numel() for p in model.parameters()),
              "group": G, "questions": args.questions, "repeats": args.repeats, "results": results}
    write_report(result, Path(args.output))


def write_report(result: dict, out: Path) -> None:
    m = result["machine"]
    lines = ["# Padding-free log-prob passes", "",
             f"Command: `python benchmarks/padding_free.py {result['argv']}`  ",
             f"Machine: {m['cpu']}, torch {m['torch']}, CPU capability **{m['cpu_capability']}**, "
             f"AVX512-BF16 flag {m['avx512_bf16']}, {result['threads']} thread(s), float32; shared "
             f"machine: {result['shared_machine']} (1-min load average at the start "
             f"{result['load_average'][0]:.1f}, at the end {result['load_average'][1]:.1f}).  ",
             f"Model: the real-shape quick model (random Qwen2, {result['parameters'] / 1e6:.1f}M "
             f"parameters, vocabulary {result['shape']['vocab']}), completions sampled from it "
             f"(up to {result['shape']['max_new']} tokens); micro-batches of G = {result['group']} rows; "
             f"{result['repeats']} interleaved repeats after a warm-up (seconds: median, range).", "",
             "Tokens: rows the q/k/v projection (per layer; the MLP and norms see the same) and the "
             "LM head receive in one no-grad pass, counted with a dispatch mode. Padding of rows: the "
             "share of the [prompt, completion] rows' tokens that are padding.", "",
             "| batch | pass | variant | seconds (median, range) | time / packed | projection tokens | head rows |",
             "|---|---|---|---|---|---|---|"]
    for name, r in result["results"].items():
        batch, kind = name.split(": ", 1)
        packed = r["variants"]["packed"]["median"]
        label = (f"{batch}: {r['rows']} rows, widths {r['prompt_width']} + {r['completion_width']}, "
                 f"padding of rows {100 * r['padding_of_rows']:.0f} %")
        for variant, v in r["variants"].items():
            lines.append(f"| {label} | {kind} | {variant} | {spread_text(v['median'], v['min'], v['max'], 3)} | "
                         f"{v['median'] / packed:.2f} | {v.get('token_rows', '')} | {v.get('head_rows', '')} |")
            label = ""
    lines += ["", "shared: G completions per prompt (as in training); distinct: one completion per "
              "prompt. packed: padding-free (the default); padded: packed=False, the same shared-prompt "
              "path in padded layout; per-sequence: one lean forward over each [prompt, completion] row "
              "(no prompt sharing)."]
    write_results(out, result, lines)


if __name__ == "__main__":
    main()
