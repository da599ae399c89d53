"""Soak test: many training steps on the shipped tiny model; does memory grow or do steps slow down?

    python benchmarks/soak.py            # 2000 steps (~5-10 min on one CPU core)
    python benchmarks/soak.py --quick    # 200 steps

Runs `CPPOTrainer` on the embedded model and task with small batches, periodic checkpoints and
held-out evaluations (so every code path of a long run is exercised), and records the resident
memory of the process (psutil, else /proc/self/status VmRSS) and the wall time of each step.
Prints a table and writes benchmarks/results/soak/soak.md and soak.png:

* memory growth per 1000 steps: slope of a least-squares line through RSS over the second half of
  the run (the first half includes allocator warm-up, first checkpoint and eval buffers);
* step time, first vs last decile of steps (median of each): a slowdown shows as a ratio > 1.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import machine, trainer_for, write_results

RESULTS = Path(__file__).resolve().parent / "results" / "soak"


def rss_mb() -> float:
    """Resident set size of this process in MiB."""
    try:
        import psutil
        return psutil.Process().memory_info().rss / 2**20
    except ImportError:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    raise RuntimeError("cannot read the resident memory (no psutil, no /proc/self/status)")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="200 steps instead of --steps")
    parser.add_argument("--steps", type=int, default=2000, help="training steps")
    parser.add_argument("--every", type=int, default=None,
                        help="record memory every N steps (default: steps / 100)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=RESULTS, help="where soak.md/png go")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps = 200
    if args.steps < 20:
        parser.error("--steps must be >= 20 (deciles need 2+ steps each)")
    args.every = args.every or max(1, args.steps // 100)
    return args


def run(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="cppo-soak-") as run_dir:
        trainer = trainer_for("embedded", quiet=False, dataset_name="embedded",
                              max_steps=args.steps, num_generations=4,
                              per_device_train_batch_size=8, pruning_rate=0.5,
                              max_completion_length=5, learning_rate=1e-5, seed=args.seed,
                              output_dir=run_dir, save_steps=max(1, args.steps // 4),
                              save_total_limit=2, eval_steps=max(1, args.steps // 4),
                              eval_num_questions=64, report_to=["jsonl"])
        step_seconds: list[tuple[int, float]] = []
        memory: list[tuple[int, float]] = [(0, rss_mb())]
        real_round = trainer.training_round

        def timed_round():
            start = time.perf_counter()
            metrics = real_round()
            step_seconds.append((trainer.run_state.step, time.perf_counter() - start))
            if trainer.run_state.step % args.every == 0:
                memory.append((trainer.run_state.step, rss_mb()))
            return metrics

        trainer.training_round = timed_round
        began = time.perf_counter()
        summary = trainer.train()   # (its end-of-run plots import matplotlib: not sampled)
        wall = time.perf_counter() - began
    return {"summary": summary, "steps": step_seconds, "memory": memory, "wall": wall}


def slope_per_1000(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of (step, MiB) points, in MiB per 1000 steps."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return 0.0 if var == 0 else 1000 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var


def analyse(result: dict) -> dict:
    times = [t for _, t in result["steps"]]
    decile = max(2, len(times) // 10)
    first, last = statistics.median(times[:decile]), statistics.median(times[-decile:])
    memory = result["memory"]
    half = [p for p in memory if p[0] >= memory[-1][0] / 2]
    return {"steps run": result["summary"]["steps"], "status": result["summary"]["status"],
            "wall time (s)": round(result["wall"], 1),
            "RSS start (MiB)": round(memory[0][1], 1), "RSS peak (MiB)": round(max(m for _, m in memory), 1),
            "RSS end (MiB)": round(memory[-1][1], 1),
            "RSS growth per 1000 steps, 2nd half (MiB)": round(slope_per_1000(half), 2),
            "RSS growth per 1000 steps, whole run (MiB)": round(slope_per_1000(memory), 2),
            "step time, first decile median (ms)": round(1000 * first, 1),
            "step time, last decile median (ms)": round(1000 * last, 1),
            "step time ratio last/first": round(last / first, 3),
            "nonfinite steps": result["summary"]["nonfinite_steps"],
            "skipped steps (zero advantage)": result["summary"]["skipped_steps"]}


def write_outputs(args, result: dict, numbers: dict) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    args.output.mkdir(parents=True, exist_ok=True)   # soak.png first
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    top.plot(*zip(*result["memory"]), lw=1)
    top.set(ylabel="resident memory (MiB)", title=f"soak: {numbers['steps run']} steps, embedded model")
    steps, times = zip(*result["steps"])
    top.grid(alpha=0.3)
    bottom.plot(steps, [1000 * t for t in times], lw=0.4, alpha=0.5, label="step")
    window = max(5, len(times) // 50)
    rolling = [statistics.median(times[max(0, i - window):i + 1]) * 1000 for i in range(len(times))]
    bottom.plot(steps, rolling, lw=1.5, label=f"rolling median ({window})")
    bottom.set(xlabel="optimizer step", ylabel="step time (ms)", yscale="log")
    bottom.legend()
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    png = args.output / "soak.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    lines = ["# Soak test", "", f"`python benchmarks/soak.py {' '.join(sys.argv[1:])}`".replace(" `", "`"),
             "", f"{time.strftime('%Y-%m-%d')}, torch threads {args.threads}, "
             f"{os.cpu_count()} CPUs, {_machine()} (shared machine: step times carry other users' load). "
             f"Memory sampled every {args.every} steps; checkpoints and held-out evals every "
             f"{max(1, args.steps // 4)} steps.", "", "| measure | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in numbers.items()]
    lines += ["", "![soak](soak.png)"]
    return write_results(args.output, None, lines, md_name="soak.md", echo=False) + [png]


def main(argv=None) -> int:
    args = parse_args(argv)
    result = run(args)
    numbers = analyse(result)
    width = max(len(k) for k in numbers)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in numbers.items()))
    for path in write_outputs(args, result, numbers):
        print(f"wrote {path}")
    return 0


def _machine() -> str:
    m = machine()
    return f"{m['cpu']}, torch {m['torch']}, CPU capability {m['cpu_capability']}, AVX512-BF16 flag {m['avx512_bf16']}"


if __name__ == "__main__":
    sys.exit(main())

