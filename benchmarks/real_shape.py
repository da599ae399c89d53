"""Speed at a real model shape: cppo (GRPO and CPPO) against TRL's GRPOTrainer and the compute bound.

A randomly initialised Qwen2 (32,768-token vocabulary; about 0.1B parameters in the full mode) with
a byte-level BPE tokenizer trained here with the `tokenizers` library on generated text, saved to
a local folder that both trainers load. Its end-of-sequence logit is calibrated so that sampled
completions stop at varied lengths (up to max_completion_length), and the reward prefers shorter
completions (a continuous reward, so no step is skipped for zero variance).

Each system runs in its own process (so peak memory is its own), in the order cppo GRPO, TRL GRPO,
cppo CPPO, repeated --repeats times (interleaved: every system sees the same machine phases); the
first step of each process is a warm-up and is not counted. Reported per executed step: the phase
times (generate / score / log-probs / update; TRL: the whole step), generation and update tokens/s
against this machine's measured matmul throughput at the same dtype (the compute bound), the
padding share of the passes' tokens before and after trimming and of the tokens the (packed) passes
compute on, peak resident memory, and the CPU capability.

    python benchmarks/real_shape.py                 # full: ~0.1B params, G = 16, 192 new tokens
    python benchmarks/real_shape.py --quick         # small: same vocabulary, 4 layers, G = 8, 64 tokens
    python benchmarks/real_shape.py --emulate-avx2  # torch held to AVX2 code paths
    python benchmarks/real_shape.py --device cuda --dtype bfloat16
    python benchmarks/real_shape.py --systems cppo_grpo trl_grpo cppo_cppo \
        cppo_grpo_bf16_sampling cppo_cppo_bf16_sampling   # + sampling from a bf16 copy
    python benchmarks/real_shape.py --profile          # where cppo's time goes -> profile.md

Writes benchmarks/results/real_shape/results.md and results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import machine, spread, trainer_for, write_results

FULL = dict(hidden=768, layers=12, heads=12, kv_heads=2, ffn=2048, vocab=32768, group=16,
            max_new=192, prompt_words=24, steps=2, repeats=1)
QUICK = dict(hidden=256, layers=4, heads=4, kv_heads=2, ffn=768, vocab=32768, group=8,
             max_new=64, prompt_words=16, steps=2, repeats=1)
CPPO_PRUNING = 0.875
# Both trainers take full optimizer steps at a rate too small to move the weights: the benchmark
# measures speed, and learning (the reward prefers short completions) would shrink the lengths
# from step to step, so later steps would not be at the shape asked for.
LEARNING_RATE = 1e-12
SYSTEMS = ("cppo_grpo", "trl_grpo", "cppo_cppo")
# the same cppo steps sampling from a bfloat16 copy of the float32 policy (generation_dtype,
# importance-sampling corrected); only where --systems names them
BF16_SAMPLING = ("cppo_grpo_bf16_sampling", "cppo_cppo_bf16_sampling")
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
SYLLABLES = ["ka", "lo", "mi", "ne", "su", "ta", "ri", "po", "ve", "da", "an", "or", "el", "is",
             "um", "th", "qu", "st", "br", "gr", "ch", "sh", "ph", "wy", "zo", "ex", "ig", "ul"]


# ----------------------------------------------------------------- assets -------------------
def words(rng: random.Random, n: int) -> list[str]:
    return ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(n)]


def build_assets(folder: Path, shape: dict) -> Path:
    """Tokenizer (BPE trained on generated text), random Qwen2 with a calibrated EOS, prompts."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    marker = folder / "shape.json"
    if marker.exists() and {k: v for k, v in json.loads(marker.read_text()).items()
                            if k != "expected_mean_length"} == {**shape, "calibration": 2}:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    text = [" ".join(words(rng, 40)) + f" {rng.randint(0, 10**6)}." for _ in range(20_000)]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    core.train_from_iterator(text, trainers.BpeTrainer(
        vocab_size=shape["vocab"], special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>")
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=shape["vocab"], hidden_size=shape["hidden"],
                         intermediate_size=shape["ffn"], num_hidden_layers=shape["layers"],
                         num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                         max_position_embeddings=1024, tie_word_embeddings=False,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         bos_token_id=None)
    model = Qwen2ForCausalLM(config)
    prompts = [{"prompt": "Repeat shortly: " + " ".join(words(rng, shape["prompt_words"])) + "\n"}
               for _ in range(512)]
    expected = calibrate_eos(model, tok, [p["prompt"] for p in prompts],
                             mean_length=shape["max_new"] * 2 / 3, max_new=shape["max_new"])
    tok.padding_side = "right"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    (folder / "prompts.json").write_text(json.dumps(prompts))
    marker.write_text(json.dumps({**shape, "calibration": 2, "expected_mean_length": expected}))
    return folder


def calibrate_eos(model, tok, prompts: list[str], mean_length: float, max_new: int) -> float:
    """Point the EOS row of the output head along channel 0 (which every token embedding shares),
    scaled so that completions sampled from this random model have about `mean_length` tokens on
    average (at most max_new), with lengths that vary. The scale is solved on sampled text: 16
    completions are sampled with EOS held back, and for a candidate scale the probability of EOS
    at each of their positions gives the expected (capped) length exactly, since holding EOS back
    does not change the distribution of the other tokens. Returns that expected mean length."""
    import torch
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1.0
        head = model.lm_head.weight
        head[tok.eos_token_id] = 0.0
        tok.padding_side = "left"
        batch = tok(prompts[:16], return_tensors="pt", padding=True)
        torch.manual_seed(0)
        ids = model.generate(**batch, do_sample=True, max_new_tokens=max_new, min_new_tokens=max_new,
                             pad_token_id=tok.pad_token_id, top_k=0, top_p=1.0)
        mask = torch.cat([batch["attention_mask"], torch.ones_like(ids[:, batch["input_ids"].shape[1]:])], 1)
        hidden = model.model(input_ids=ids, attention_mask=mask,
                             position_ids=(mask.cumsum(1) - 1).clamp(min=0)).last_hidden_state
        hidden = hidden[:, batch["input_ids"].shape[1] - 1:-1]      # the states predicting each new token
        logits = model.lm_head(hidden)
        logits[..., tok.eos_token_id] = float("-inf")
        others, channel = torch.logsumexp(logits, -1), hidden[..., 0]

        def expected_length(scale: float) -> float:
            stop = torch.sigmoid(scale * channel - others)            # P(EOS) at each position
            survive = torch.cumprod(1 - stop, dim=1)[:, :-1]
            return float((1 + survive.sum(1)).mean())
        lo, hi = 0.0, 1000.0                                        # longer at lo, shorter at hi
        for _ in range(60):
            scale = (lo + hi) / 2
            lo, hi = (scale, hi) if expected_length(scale) > mean_length else (lo, scale)
        head[tok.eos_token_id, 0] = scale
        return expected_length(scale)


def cppo_fields(shape: dict, pruning_rate: float = CPPO_PRUNING) -> dict:
    """The CPPOConfig fields of a cppo run at `shape` (G completions a question, one update of G,
    TRL's loss and an inert learning rate), for trainer_for or `cppo train`."""
    return dict(pruning_rate=pruning_rate, num_generations=shape["group"],
                per_device_train_batch_size=shape["group"], max_completion_length=shape["max_new"],
                max_prompt_length=128, beta=0.0, loss_type="dapo", learning_rate=LEARNING_RATE)


def shorter_is_better(prompts, completions, completion_ids=None, **kw):
    """Reward in [0, 1]: 1 - characters / 2048 of the completion text (continuous, so groups
    have variance; the same for both trainers, which give it the same text)."""
    return [1.0 - min(len(text), 2048) / 2048 for text in completions]


# ----------------------------------------------------------------- compute bound -------------
def matmul_gflops(m: int, k: int, n: int, dtype: str, device: str, seconds: float = 1.0) -> float:
    """Measured throughput of an (m, k) @ (k, n) matmul at dtype on device (median of runs)."""
    import torch
    dt = getattr(torch, dtype)
    a = torch.randn(m, k, device=device, dtype=dt)
    b = torch.randn(k, n, device=device, dtype=dt)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    (a @ b), sync()
    times, start = [], time.perf_counter()
    while time.perf_counter() - start < seconds or len(times) < 3:
        t = time.perf_counter()
        (a @ b), sync()
        times.append(time.perf_counter() - t)
    return 2 * m * k * n / statistics.median(times) / 1e9


def linear_seconds(dtype: str, device: str, rows: int = 800, n_in: int = 576, n_out: int = 1536,
                   repeats: int = 5) -> dict:
    """Median seconds of a Linear's forward, weight gradient and input gradient at dtype (the
    shape of a 135M Llama's MLP on 800 tokens): where bf16 pays and where it is a trap."""
    import torch
    dt = getattr(torch, dtype)
    x = torch.randn(rows, n_in, device=device, dtype=dt)
    w = torch.randn(n_out, n_in, device=device, dtype=dt) * 0.02
    g = torch.randn(rows, n_out, device=device, dtype=dt)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    ops = {"forward": lambda: x @ w.T, "weight_grad": lambda: g.T @ x, "input_grad": lambda: g @ w}
    out = {}
    for name, op in ops.items():
        op(), sync()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            op(), sync()
            times.append(time.perf_counter() - t)
        out[name] = statistics.median(times)
    return out


def flops_per_token(shape: dict, context: int) -> float:
    """Forward FLOPs per token: 2 x (layer weights + output head) + attention over `context`."""
    h, f, L, v = shape["hidden"], shape["ffn"], shape["layers"], shape["vocab"]
    kv = h // shape["heads"] * shape["kv_heads"]
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * f
    return 2 * (L * per_layer + h * v) + 4 * L * context * h


# ----------------------------------------------------------------- workers -------------------
def worker(system: str, folder: Path, shape: dict, device: str, dtype: str, threads: int) -> dict:
    import torch
    torch.set_num_threads(threads)
    rows = json.loads((folder / "prompts.json").read_text())
    steps = 1 + shape["steps"]                  # the first is a warm-up
    if system.startswith("cppo"):
        out = run_cppo(system, folder, rows, shape, device, dtype, steps)
    else:
        out = run_trl(folder, rows, shape, device, dtype, steps)
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if device == "cuda":
        out["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def run_cppo(system, folder, rows, shape, device, dtype, steps) -> dict:
    P = 0.0 if system.startswith("cppo_grpo") else CPPO_PRUNING
    low = dtype == "bfloat16"
    bf16_sampling = low or system in BF16_SAMPLING
    trainer = trainer_for(str(folder), rows, shorter_is_better, prefix="cppo_real_shape_",
                          **cppo_fields(shape, P), max_steps=steps, eval_steps=0, save_steps=0,
                          seed=0, bf16=low, generation_dtype="bfloat16" if bf16_sampling else None,
                          matmul_dtype=None)   # training passes in float32 (or bf16 autocast), as TRL's
    padding = []
    build = trainer.build_batch

    def counted_build(prompts, completions, advantages, keep_mask):
        batch = build(prompts, completions, advantages, keep_mask)
        kept = int(keep_mask.sum())
        real = int(batch.prompt_mask.sum() + batch.completion_mask.sum())
        before = kept * (prompts.ids.shape[1] + completions.ids.shape[1])
        after = sum(len(m) * (m.prompt_ids.shape[1] + m.completion_ids.shape[1])
                    for m in batch.micro_batches(trainer.args.per_device_train_batch_size))
        padding.append({"before": 1 - real / before, "after": 1 - real / after,
                        "kept_rows": kept, "scored_width": completions.ids.shape[1],
                        "kept_width": batch.completion_ids.shape[1]})
        return batch
    trainer.build_batch = counted_build
    from cppo.models.lean import LeanForward
    work = {"computed": 0.0, "needed": 0}    # tokens the packed passes' projections see / need
    qkv, scoring = LeanForward._qkv_packed, LeanForward.completion_logits

    def counted_qkv(self, w, h, rope):
        work["computed"] += h.shape[0] / len(self.model.model.layers)
        return qkv(self, w, h, rope)

    def counted_scoring(self, prompt_ids, prompt_mask, question, completion_ids, completion_mask, **kw):
        # each distinct prompt's real tokens, each completion's real tokens but its last
        work["needed"] += int(prompt_mask.sum() + (completion_mask.sum(1) - 1).clamp(min=0).sum())
        return scoring(self, prompt_ids, prompt_mask, question, completion_ids, completion_mask, **kw)
    LeanForward._qkv_packed, LeanForward.completion_logits = counted_qkv, counted_scoring
    records = []
    for i in range(steps):
        work.update(computed=0.0, needed=0)
        start = time.perf_counter()
        metrics = trainer.training_round()
        took = time.perf_counter() - start
        if padding and work["computed"]:   # share of the tokens the passes compute on that are padding
            padding[-1]["packed"] = 1 - work["needed"] / work["computed"]
        phases = trainer.timer.pop_last()
        records.append({"seconds": took, **phases, "skipped": bool(metrics.get("cppo/skipped")),
                        "completions": metrics["cppo/completions_scored"],
                        "questions": metrics["cppo/questions_per_step"],
                        "tokens_generated": metrics["completions/mean_length"] * metrics["cppo/completions_scored"],
                        "kept": metrics["cppo/completions_kept"], "padding": padding[-1] if padding else None,
                        "update_tokens": work["computed"]})
    return {"steps": records[1:], "warmup": records[:1],
            "parameters": sum(p.numel() for p in trainer.policy.parameters())}


def run_trl(folder, rows, shape, device, dtype, steps) -> dict:
    import contextlib
    import io
    import warnings
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    import trl
    bounds: list[list[float]] = []
    tokens: list[int] = []

    def reward(prompts, completions, completion_ids=None, **kw):
        tokens.append(sum(len(ids) for ids in completion_ids))
        return shorter_is_better(prompts, completions, completion_ids)

    class StepClock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            bounds.append([time.perf_counter()])

        def on_step_end(self, *a, **k):
            bounds[-1].append(time.perf_counter())

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl_real_shape_"), per_device_train_batch_size=shape["group"],
        num_generations=shape["group"], max_completion_length=shape["max_new"], max_steps=steps,
        learning_rate=LEARNING_RATE, beta=0.0, loss_type="dapo", num_iterations=1, temperature=1.0,
        use_cpu=device == "cpu", bf16=dtype == "bfloat16", report_to="none", save_strategy="no",
        logging_steps=steps + 1, disable_tqdm=True, seed=0, dataloader_num_workers=0)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(folder)
        trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=config,
                              train_dataset=Dataset.from_list(rows),
                              processing_class=AutoTokenizer.from_pretrained(folder),
                              callbacks=[StepClock()])
        trainer.train()
    records = [{"seconds": b - a, "completions": shape["group"], "questions": 1,
                "tokens_generated": n} for (a, b), n in zip(bounds, tokens)]
    return {"steps": records[1:], "warmup": records[:1], "trl_version": trl.__version__,
            "parameters": sum(p.numel() for p in model.parameters())}


# ----------------------------------------------------------------- report --------------------
def summarise(runs: dict[str, list[dict]], shape: dict, bound: dict) -> dict:
    out = {}
    for system, results in runs.items():
        steps = [s for r in results for s in r["steps"] if not s.get("skipped")]
        if not steps:
            out[system] = {"error": "no executed step"}
            continue
        med = lambda k: statistics.median(s.get(k, 0.0) for s in steps)
        seconds = spread([s["seconds"] for s in steps])
        row = {"executed_steps": len(steps), "seconds_per_step": seconds["median"],
               "step_range": [seconds["min"], seconds["max"]],
               "questions_per_step": med("questions"), "completions_per_step": med("completions"),
               "tokens_generated_per_step": med("tokens_generated"),
               "peak_rss_mb": max(r["peak_rss_mb"] for r in results),
               "parameters": results[0]["parameters"]}
        row["seconds_per_question"] = row["seconds_per_step"] / row["questions_per_step"]
        if system.startswith("cppo"):
            for k in ("generate", "score", "logprobs", "update"):
                row[k] = med(k)
            ctx = shape["prompt_words"] * 2 + shape["max_new"] // 2
            gen_tps = sum(s["tokens_generated"] for s in steps) / sum(s["generate"] for s in steps)
            row["generation_tokens_per_s"] = gen_tps
            row["generation_gflops"] = gen_tps * flops_per_token(shape, ctx) / 1e9
            row["generation_batch"] = row["completions_per_step"]
            row["generation_bound_gflops"] = bound["decode"] if row["generation_batch"] >= 64 \
                else bound["decode_small"]
            row["generation_share_of_bound"] = row["generation_gflops"] / row["generation_bound_gflops"]
            pads = [s["padding"] for s in steps if s.get("padding")]
            row["padding_before"] = statistics.mean(p["before"] for p in pads)
            row["padding_after"] = statistics.mean(p["after"] for p in pads)
            packed = [p["packed"] for p in pads if "packed" in p]
            row["padding_packed"] = statistics.mean(packed) if packed else None
            # the tokens the packed update pass computes on (each distinct prompt once, no padding)
            row["update_tokens_per_s"] = sum(s["update_tokens"] for s in steps) / sum(s["update"] for s in steps)
            row["update_gflops"] = row["update_tokens_per_s"] * 3 * flops_per_token(shape, ctx) / 1e9
            row["update_share_of_bound"] = row["update_gflops"] / bound["update"]
        out[system] = row
    grpo, trl_row, cppo = (out.get(s, {}) for s in SYSTEMS)
    if "seconds_per_step" in grpo and "seconds_per_step" in trl_row:
        out["goals"] = {
            "grpo_step_speedup_vs_trl": trl_row["seconds_per_step"] / grpo["seconds_per_step"],
            "cppo_per_question_speedup_vs_trl": trl_row["seconds_per_question"] / cppo["seconds_per_question"]
            if "seconds_per_question" in cppo else None,
            "generation_share_of_bound_batch_ge_64": cppo.get("generation_share_of_bound")}
        low_grpo, low_cppo = (out.get(s, {}) for s in BF16_SAMPLING)
        if "seconds_per_step" in low_grpo:
            out["goals"]["bf16_sampling_grpo_step_speedup_vs_trl"] = \
                trl_row["seconds_per_step"] / low_grpo["seconds_per_step"]
        if "seconds_per_question" in low_cppo:
            out["goals"]["bf16_sampling_cppo_per_question_speedup_vs_trl"] = \
                trl_row["seconds_per_question"] / low_cppo["seconds_per_question"]
            if "seconds_per_question" in cppo:
                out["goals"]["bf16_sampling_cppo_per_question_speedup_vs_float32"] = \
                    cppo["seconds_per_question"] / low_cppo["seconds_per_question"]
    return out


def write_report(result: dict, out: Path) -> None:
    m, s, shape, bound = result["machine"], result["summary"], result["shape"], result["bound"]
    f = lambda v, d=2: "n/a" if v is None else f"{v:.{d}f}"
    lines = [f"# Real-shape benchmark{' (quick mode)' if result['quick'] else ''}", "",
             f"Command: `python benchmarks/real_shape.py {result['argv']}`  ",
             f"Machine: {m['cpu']}, torch {m['torch']}, CPU capability **{m['cpu_capability']}**"
             f"{' (emulated: ' + result['emulation'] + ')' if result['emulation'] else ''}, "
             f"AVX512-BF16 flag {m['avx512_bf16']}, fast bf16 here {m['fast_bfloat16']}, "
             f"{result['threads']} threads, device {result['device']}, dtype {result['dtype']}; "
             f"shared machine: {result['shared']} (1-min load average at the start "
             f"{result['load_average'][0]:.1f}, at the end {result['load_average'][1]:.1f}).  ",
             f"Model: random Qwen2, {max(r.get('parameters', 0) for v in result['runs'].values() for r in v) / 1e6:.1f}M parameters "
             f"(hidden {shape['hidden']}, {shape['layers']} layers, vocabulary {shape['vocab']}, "
             f"BPE tokenizer trained here); G = {shape['group']}, up to {shape['max_new']} new tokens, "
             f"{shape['steps']} timed steps per process after 1 warm-up, {shape['repeats']} "
             f"interleaved repeat(s).  ",
             f"Compute bound (measured {result['dtype']} matmul here): {f(bound['update'], 1)} GFLOP/s "
             f"at many rows (update), {f(bound['decode'], 1)} GFLOP/s at {bound['decode_rows']} rows "
             f"(decode), {f(bound['decode_small'], 1)} GFLOP/s at {shape['group']} rows.", "",
             "| system | executed steps | s/step (median, range) | questions/step | s/question | "
             "generate | score | log-probs | update | gen tok/s (% of bound) | update tok/s (% of bound) | "
             "padding before -> after trim -> computed (packed) | peak RSS MB |", "|" + "---|" * 13]
    for name in SYSTEMS + tuple(n for n in BF16_SAMPLING if n in s):
        r = s.get(name, {})
        if "seconds_per_step" not in r:
            lines.append(f"| {name} | {r.get('error', 'not run')} |" + " |" * 12)
            continue
        cppo = name.startswith("cppo")
        lines.append(
            f"| {name} | {r['executed_steps']} | {f(r['seconds_per_step'])} ({f(r['step_range'][0])}-"
            f"{f(r['step_range'][1])}) | {r['questions_per_step']:.0f} | {f(r['seconds_per_question'])} | "
            + (f"{f(r['generate'])} | {f(r['score'])} | {f(r['logprobs'])} | {f(r['update'])} | "
               f"{f(r['generation_tokens_per_s'], 0)} ({100 * r['generation_share_of_bound']:.0f} %, batch "
               f"{r['generation_batch']:.0f}) | {f(r['update_tokens_per_s'], 0)} "
               f"({100 * r['update_share_of_bound']:.0f} %) | {100 * r['padding_before']:.0f} % -> "
               f"{100 * r['padding_after']:.0f} % -> "
               + ("n/a" if r.get("padding_packed") is None else f"{abs(100 * r['padding_packed']):.0f} %")
               + " | " if cppo else "whole step | | | | | | | ")
            + f"{r['peak_rss_mb']:.0f} |")
    g = s.get("goals")
    if g:
        lines += ["", "Goals:",
                  f"- cppo GRPO step >= 2x faster than TRL's: **{f(g['grpo_step_speedup_vs_trl'])}x** "
                  f"({'met' if g['grpo_step_speedup_vs_trl'] >= 2 else 'missed'})",
                  f"- CPPO (P = {CPPO_PRUNING}) >= 5x faster than TRL's GRPO per training question: "
                  f"**{f(g['cppo_per_question_speedup_vs_trl'])}x** "
                  f"({'met' if (g['cppo_per_question_speedup_vs_trl'] or 0) >= 5 else 'missed'})",
                  f"- generation at batch >= 64 at >= 50 % of the compute bound: "
                  f"**{100 * (g['generation_share_of_bound_batch_ge_64'] or 0):.0f} %** "
                  f"({'met' if (g['generation_share_of_bound_batch_ge_64'] or 0) >= 0.5 else 'missed'})"]
        if "bf16_sampling_grpo_step_speedup_vs_trl" in g:
            lines.append(f"- sampling from a bf16 copy: cppo GRPO step against TRL's: "
                         f"**{f(g['bf16_sampling_grpo_step_speedup_vs_trl'])}x**")
        if "bf16_sampling_cppo_per_question_speedup_vs_trl" in g:
            lines.append(f"- sampling from a bf16 copy: CPPO per training question against TRL's GRPO: "
                         f"**{f(g['bf16_sampling_cppo_per_question_speedup_vs_trl'])}x**"
                         + (f"; against CPPO sampling in float32: "
                            f"**{f(g['bf16_sampling_cppo_per_question_speedup_vs_float32'])}x**"
                            if "bf16_sampling_cppo_per_question_speedup_vs_float32" in g else ""))
    prec = result["precision"]
    lines += ["", "A Linear of 800 tokens x 576 -> 1536 (milliseconds, median of 5; bf16 / fp32 > 1: "
              "bf16 is slower):", "", "| pass | float32 | bfloat16 | bf16 / fp32 |", "|---|---|---|---|"]
    for op in ("forward", "weight_grad", "input_grad"):
        a, b = prec["float32"][op], prec["bfloat16"][op]
        lines.append(f"| {op} | {1e3 * a:.1f} | {1e3 * b:.1f} | {b / a:.2f} |")
    lines += ["", "FLOPs are counted as 2 x (layer weights + output head) per generated token plus "
              "attention, and 3x that per trained token (forward + backward). s/question = s/step / "
              "questions per step (CPPO samples 1/(1-P) questions per update of G completions)."]
    if any(n in s for n in BF16_SAMPLING):
        lines.append("The *_bf16_sampling rows train in float32 and sample from a bfloat16 copy "
                     "(generation_dtype: bfloat16, importance-sampling corrected); their generation "
                     "share is of the float32 bound above.")
    write_results(out, result, lines)


# ----------------------------------------------------------------- profile --------------------
def profile_phases(folder: Path, shape: dict, device: str, dtype: str, out: Path,
                       argv: str, shared: bool) -> None:
    """torch.profiler tables of cppo's sampling for the CPPO step (1/(1-P) questions x G) and the
    GRPO step (1 question x G), and of the update pass (forward + backward of the packed log-probs
    of G completions): the operators that take the time, written to profile.md. Each is run once
    before it is profiled."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from cppo.models import load_model, load_tokenizer
    from cppo.sampling.logprobs import completion_logprobs
    from cppo.sampling.sampler import encode_prompts, sample_completions
    model = load_model(str(folder), torch_dtype=dtype).to(device).eval()
    tok = load_tokenizer(str(folder))
    rows = json.loads((folder / "prompts.json").read_text())
    cppo_questions = round(1 / (1 - CPPO_PRUNING))
    kw = dict(num_generations=shape["group"], max_new_tokens=shape["max_new"],
              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    m = machine(device)
    lines = ["# Where cppo's time goes at real shape", "",
             f"Command: `python benchmarks/real_shape.py {argv}`  ",
             f"Machine: {m['cpu']}, torch {m['torch']}, CPU capability **{m['cpu_capability']}**, "
             f"AVX512-BF16 flag {m['avx512_bf16']}, {torch.get_num_threads()} threads, device {device}, "
             f"dtype {dtype}; shared machine: {shared}.  ",
             f"Model: hidden {shape['hidden']}, {shape['layers']} layers, vocabulary {shape['vocab']}; "
             f"G = {shape['group']}, up to {shape['max_new']} new tokens. Operators by their own time "
             f"(torch.profiler, CPU), as a share of the profiled call's wall time.", ""]

    def profiled(title: str, run) -> None:
        run()
        start = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            note = run()
        wall = time.perf_counter() - start
        ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:10]
        lines.extend([f"## {title}", "", f"{note}; {wall:.2f} s under the profiler.", "",
                      "| operator | calls | seconds (own) | share |", "|---|---|---|---|"])
        for e in ops:
            own = e.self_cpu_time_total / 1e6
            lines.append(f"| `{e.key}` | {e.count} | {own:.3f} | {100 * own / wall:.0f} % |")
        lines.append("")

    def sampler(questions: int):
        prompts = encode_prompts(tok, [r["prompt"] for r in rows[:questions]])

        def run() -> str:
            done = sample_completions(model, prompts, generator=torch.Generator(device).manual_seed(1), **kw)
            return (f"{questions} question(s) x G = {shape['group']} = {len(done.ids)} completions, "
                    f"mean length {float(done.lengths.float().mean()):.1f}")
        return run, prompts

    cppo_sampling, _ = sampler(cppo_questions)
    profiled("Sampling, the CPPO step's batch", cppo_sampling)
    grpo_sampling, prompts = sampler(1)
    profiled("Sampling, the GRPO step's batch", grpo_sampling)
    done = sample_completions(model, prompts, generator=torch.Generator(device).manual_seed(2), **kw)
    batch = (prompts.ids.repeat_interleave(shape["group"], 0), prompts.mask.repeat_interleave(shape["group"], 0),
             done.ids, done.mask)
    model.train()

    def update() -> str:
        logps = completion_logprobs(model, *batch)
        (logps * done.mask).sum().backward()
        model.zero_grad(set_to_none=True)
        return (f"forward + backward of the packed log-probs of {len(done.ids)} completions "
                f"({int(done.mask.sum())} completion tokens)")
    profiled("Update pass (policy forward + backward), G completions", update)
    write_results(out, None, lines, md_name="profile.md")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=None, help="timed steps per process")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved repeats")
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS + BF16_SAMPLING)
    parser.add_argument("--emulate-avx2", action="store_true")
    parser.add_argument("--shared", action="store_true", help="record that other work shared the machine")
    parser.add_argument("--assets", default=None, help="model folder (default: a cache under /tmp)")
    parser.add_argument("--output", default="benchmarks/results/real_shape")
    parser.add_argument("--from-json", help="only re-render results.md from this results.json")
    parser.add_argument("--profile", action="store_true",
                        help="only profile cppo's sampling and update pass -> profile.md")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = dict(QUICK if args.quick else FULL)
    for key in ("steps", "repeats"):
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    folder = Path(args.assets or Path(tempfile.gettempdir()) / f"cppo_real_shape_{'quick' if args.quick else 'full'}")
    if args.from_json:
        result = json.loads(Path(args.from_json).read_text())
        result["summary"] = summarise(result["runs"], result["shape"], result["bound"])
        write_report(result, Path(args.output))
        return
    if args.worker:
        result = worker(args.worker, folder, shape, args.device, args.dtype, args.threads)
        Path(args.worker_out).write_text(json.dumps(result))
        return
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    if args.emulate_avx2:
        env.update(AVX2_ENV)
    os.environ.update(env)
    import torch
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()[0]
    build_assets(folder, {k: v for k, v in shape.items() if k not in ("steps", "repeats")})
    if args.profile:
        profile_phases(folder, shape, args.device, args.dtype, Path(args.output),
                           " ".join(sys.argv[1:]), args.shared)
        return
    rows_decode = 64 if args.quick else 128
    bound = {"update": matmul_gflops(2048, shape["hidden"], shape["ffn"], args.dtype, args.device),
             "decode": matmul_gflops(rows_decode, shape["hidden"], shape["ffn"], args.dtype, args.device),
             "decode_small": matmul_gflops(shape["group"], shape["hidden"], shape["ffn"], args.dtype, args.device),
             "decode_rows": rows_decode}
    precision = {d: linear_seconds(d, args.device) for d in ("float32", "bfloat16")}
    runs: dict[str, list[dict]] = {s: [] for s in args.systems}
    for repeat in range(shape["repeats"]):
        for system in args.systems:
            with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
                cmd = [sys.executable, __file__, "--worker", system, "--worker-out", tmp.name,
                       "--device", args.device, "--dtype", args.dtype, "--threads", str(args.threads),
                       "--assets", str(folder), "--steps", str(shape["steps"])] + (["--quick"] if args.quick else [])
                print(f"repeat {repeat + 1}/{shape['repeats']}: {system}", flush=True)
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
                if proc.returncode != 0:
                    print(proc.stderr[-3000:])
                    runs[system].append({"steps": [], "error": proc.stderr[-500:], "peak_rss_mb": 0,
                                         "parameters": 0})
                    continue
                runs[system].append(json.loads(Path(tmp.name).read_text()))
    result = {"argv": " ".join(sys.argv[1:]), "quick": args.quick, "device": args.device,
              "dtype": args.dtype, "threads": args.threads, "shared": args.shared,
              "emulation": ", ".join(f"{k}={v}" for k, v in AVX2_ENV.items()) if args.emulate_avx2 else "",
              "machine": machine(args.device), "shape": shape, "bound": bound,
              "load_average": [load_start, os.getloadavg()[0]], "precision": precision, "runs": runs}
    result["summary"] = summarise(runs, shape, bound)
    write_report(result, Path(args.output))


if __name__ == "__main__":
    main()
