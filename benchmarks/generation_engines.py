"""Generation engines: vLLM (its CPU build, colocated) against cppo's own sampler, in a GRPO step.

For each model, each engine runs in its own process: a CPPOTrainer is built (the start-up time
includes vLLM's engine start), then 1 warm-up training round and --rounds timed ones run. Each
round generates the step's completions (with vLLM: after pushing the policy's weights into the
engine and checking them, which is part of its generation time), scores, prunes and updates.
Reported per model and engine: start-up seconds, completions/s and new tokens/s of the generation
phase, the whole round's seconds (a GRPO step with CPPO's pruning), median and range over the
timed rounds, with the CPU capability and the 1-minute load average before and after each process.

Models: `embedded` (cppo's default: the shipped tiny model and task, CPPO with G = 8, P = 0.75)
and `real_shape` (benchmarks/real_shape.py's random Qwen2 with a trained BPE tokenizer: --quick
shape by default, 19.9M parameters, G = 8, up to 64 new tokens; --full: ~0.1B, G = 16, 192 tokens;
CPPO with P = 0.875 as there).

    python benchmarks/generation_engines.py                     # both models, both engines
    python benchmarks/generation_engines.py --models embedded --rounds 5
    python benchmarks/generation_engines.py --full --shared
    python benchmarks/generation_engines.py --engines cppo_sampler cppo_sampler_bf16 vllm

Writes benchmarks/results/generation_engines/results.md and results.json.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import machine, spread, spread_text, trainer_for, write_results

HERE = Path(__file__).resolve().parent
ENGINES = ("cppo_sampler", "vllm")
# cppo's sampler on a bfloat16 copy of the float32 policy (generation_dtype, importance-sampling
# corrected); only where --engines names it
BF16_SAMPLER = "cppo_sampler_bf16"
MODELS = ("embedded", "real_shape")


def engine_trainer(model: str, engine: str, folder: Path | None, shape: dict):
    """A CPPOTrainer on the model, generating with the engine (vLLM colocated, awake)."""
    engine_fields = dict(use_vllm=engine == "vllm", vllm_enable_sleep_mode=False, eval_steps=0,
                         generation_dtype="bfloat16" if engine == BF16_SAMPLER else None,
                         save_steps=0, prefix="cppo_engines_")
    if model == "embedded":
        return trainer_for(**engine_fields)
    sys.path.insert(0, str(HERE))
    import real_shape
    rows = json.loads((folder / "prompts.json").read_text())
    return trainer_for(str(folder), rows, real_shape.shorter_is_better, seed=0,
                       **real_shape.cppo_fields(shape), **engine_fields)


def worker(model: str, engine: str, folder: Path | None, shape: dict, rounds: int, threads: int) -> dict:
    import torch
    torch.set_num_threads(threads)
    start = time.perf_counter()
    trainer = engine_trainer(model, engine, folder, shape)
    startup = time.perf_counter() - start
    generated = []
    generate = trainer.generate

    def counted(rows):
        prompts, completions = generate(rows)
        generated.append((int(completions.ids.shape[0]), int(completions.mask.sum())))
        return prompts, completions
    trainer.generate = counted
    records = []
    for i in range(rounds + 1):            # round 0 warms up
        begin = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            trainer.training_round()
        took = time.perf_counter() - begin
        phases = trainer.timer.pop_last()
        completions, tokens = generated[-1]
        if i:
            records.append({"round_seconds": took, "generate_seconds": phases["generate"],
                            "completions": completions, "new_tokens": tokens})
    close = getattr(trainer.backend, "close", None)
    if close:
        close()
    import shutil
    shutil.rmtree(trainer.args.output_dir, ignore_errors=True)   # the run directory: not needed
    return {"startup_seconds": startup, "rounds": records,
            "parameters": sum(p.numel() for p in trainer.policy.parameters())}


def summarise(runs: list[dict]) -> dict:
    rounds = [r for run in runs for r in run["rounds"]]
    return {"startup_seconds": spread([run["startup_seconds"] for run in runs]),
            "completions_per_second": spread([r["completions"] / r["generate_seconds"] for r in rounds]),
            "new_tokens_per_second": spread([r["new_tokens"] / r["generate_seconds"] for r in rounds]),
            "generate_seconds": spread([r["generate_seconds"] for r in rounds]),
            "round_seconds": spread([r["round_seconds"] for r in rounds]),
            "completions_per_round": rounds[0]["completions"], "timed_rounds": len(rounds)}


def fmt(s: dict, digits: int = 2) -> str:
    return spread_text(s["median"], s["min"], s["max"], digits)


def write_report(result: dict, out: Path) -> None:
    m = result["machine"]
    lines = [f"# Generation engines (`python benchmarks/generation_engines.py {result['argv']}`)", "",
             f"Machine: {m['cpu']}, torch {m['torch']}, vLLM {result['vllm']} (CPU build), CPU "
             f"capability **{m['cpu_capability']}**, {result['threads']} threads per process; "
             f"shared with other work: {result['shared']} (1-minute load average from "
             f"{min(result['load_averages']):.2f} to {max(result['load_averages']):.2f} over the "
             f"runs). Median (range) over {result['rounds']} timed rounds per process after 1 "
             f"warm-up, {result['repeats']} process(es) per engine and model, interleaved.", "",
             "| model | engine | start-up s | completions / round | completions/s (generate) | "
             "new tokens/s | generate s / round | whole round s (GRPO step with CPPO) |",
             "|---|---|---|---|---|---|---|---|"]
    for model, engines in result["summary"].items():
        for engine, s in engines.items():
            lines.append(f"| {model} ({result['parameters'][model] / 1e6:.1f}M) | {engine} | "
                         f"{fmt(s['startup_seconds'], 1)} | {s['completions_per_round']} | "
                         f"{fmt(s['completions_per_second'], 0)} | {fmt(s['new_tokens_per_second'], 0)} | "
                         f"{fmt(s['generate_seconds'])} | {fmt(s['round_seconds'])} |")
    lines += ["", "vLLM's generation time includes the weight push into the engine before each "
              "round and the 4-token check after it (both part of every real round)."]
    if BF16_SAMPLER in {e for engines in result["summary"].values() for e in engines}:
        lines += ["", f"{BF16_SAMPLER}: cppo's sampler on a bfloat16 copy of the float32 policy "
                  "(generation_dtype: bfloat16, importance-sampling corrected); the other engines "
                  "sample in float32."]
    if result.get("note"):
        lines += ["", result["note"]]
    write_results(out, result, lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES + (BF16_SAMPLER,))
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per process")
    parser.add_argument("--repeats", type=int, default=1, help="processes per engine and model")
    parser.add_argument("--full", action="store_true", help="the full real-shape model (~0.1B)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shared", action="store_true", help="record that other work shared the machine")
    parser.add_argument("--note", default="", help="a line for the report")
    parser.add_argument("--output", default=str(HERE / "results" / "generation_engines"))
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "ENGINE"), help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    import real_shape
    shape = dict(real_shape.FULL if args.full else real_shape.QUICK)
    folder = Path(tempfile.gettempdir()) / f"cppo_real_shape_{'full' if args.full else 'quick'}"
    if args.worker:
        out = worker(*args.worker, folder, shape, args.rounds, args.threads)
        Path(args.worker_out).write_text(json.dumps(out))
        return
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    if "real_shape" in args.models:
        real_shape.build_assets(folder, {k: v for k, v in shape.items() if k not in ("steps", "repeats")})
    runs = {m: {e: [] for e in args.engines} for m in args.models}
    loads, parameters = [os.getloadavg()[0]], {}
    for repeat in range(args.repeats):
        for model in args.models:
            for engine in args.engines:
                print(f"repeat {repeat + 1}/{args.repeats}: {model} / {engine}", flush=True)
                with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
                    cmd = [sys.executable, __file__, "--worker", model, engine, "--worker-out",
                           tmp.name, "--rounds", str(args.rounds), "--threads", str(args.threads)]
                    cmd += ["--full"] if args.full else []
                    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
                    loads.append(os.getloadavg()[0])
                    if proc.returncode != 0:
                        raise SystemExit(f"{model} / {engine} failed:\n{proc.stderr[-3000:]}")
                    out = json.loads(Path(tmp.name).read_text())
                runs[model][engine].append(out)
                parameters[model] = out["parameters"]
    import vllm
    result = {"argv": " ".join(sys.argv[1:]), "machine": machine(), "vllm": vllm.__version__,
              "threads": args.threads, "shared": args.shared, "load_averages": loads,
              "rounds": args.rounds, "repeats": args.repeats, "parameters": parameters,
              "shape": shape, "runs": runs, "note": args.note,
              "summary": {m: {e: summarise(r) for e, r in engines.items()} for m, engines in runs.items()}}
    write_report(result, Path(args.output))


if __name__ == "__main__":
    main()
