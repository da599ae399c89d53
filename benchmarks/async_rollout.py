"""Asynchronous rollouts against synchronous ones, on split hardware emulated on this machine.

The trainer runs on core 0 with one thread, the generator process on core 1 with one thread
(async_rollout's generator_cpus / generator_threads), so the two sides never share a core, as on
a machine with separate generation and training devices. Rows, for GRPO (pruning_rate 0) and
CPPO:

* sync: max_staleness 0 -- each round is sampled by the policy that trains on it, so each side
  waits for the other (as server-mode generation does);
* async S: max_staleness S (1, 2, 4) -- the generator samples up to S rounds ahead.

Each row is a fresh `cppo train` process; its first steps (the generator's start-up) are not
counted. Reported per row: seconds per optimizer step and per training question, the speed-up
over sync, the overlap bound measured in the sync row of the same run, 1 / max(generation share,
training share), and the share of that bound reached; mean staleness and rounds dropped as stale.
`--accuracy` adds held-out greedy accuracy after the same training steps (3 seeds, embedded
default) to the committed results.
A projection feeds the measured phase times to a simulator of 1+1 and 4+4 device splits.

    python benchmarks/async_rollout.py                       # embedded default and real shape
    python benchmarks/async_rollout.py --accuracy              # + held-out accuracy, 3 seeds
    python benchmarks/async_rollout.py --real quick          # the small real-shape model

Writes benchmarks/results/async_rollout/results.md and results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "async_rollout"
MODES = {"sync": 0, "async S=1": 1, "async S=2": 2, "async S=4": 4}
ALGORITHMS = {"GRPO": 0.0, "CPPO": None}   # None: the model's CPPO pruning rate
STEPS = {"embedded": (40, 5), "real": (6, 2)}   # (steps run, first steps not counted)
ACCURACY_STEPS, SEEDS = 150, (42, 1, 2)


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def run_config(model: str, real: str, algorithm: str, staleness: int, seed: int,
               steps: int, out: Path, eval_steps: int = 0) -> dict:
    """CPPOConfig values of one row."""
    values = dict(output_dir=str(out), max_steps=steps, seed=seed, async_rollout=True,
                  max_staleness=staleness, generator_cpus=[1], generator_threads=1,
                  queue_maxsize=1 << 20, eval_steps=eval_steps, save_steps=0, progress_bar=False,
                  report_to=["jsonl"])
    if ALGORITHMS[algorithm] is not None:
        values["pruning_rate"] = ALGORITHMS[algorithm]
    if model == "real":
        sys.path.insert(0, str(HERE))
        import real_shape
        shape = real_shape.FULL if real == "full" else real_shape.QUICK
        folder = real_shape.build_assets(Path(tempfile.gettempdir()) / f"cppo_async_{real}", shape)
        values.update(model=str(folder), dataset_name=str(folder / "prompts.jsonl"),
                      reward_funcs=["real_shape:shorter_is_better"],
                      num_generations=shape["group"], per_device_train_batch_size=shape["group"],
                      max_completion_length=shape["max_new"], max_prompt_length=128, beta=0.0,
                      loss_type="dapo", learning_rate=real_shape.LEARNING_RATE,
                      generation_dtype="bfloat16", matmul_dtype=None, eval_steps=0)
        if ALGORITHMS[algorithm] is None:
            values["pruning_rate"] = real_shape.CPPO_PRUNING
    return values


def worker(values: dict) -> None:
    """One row in this process: the trainer on core 0 with one thread."""
    os.sched_setaffinity(0, {0})
    import torch
    torch.set_num_threads(1)
    sys.path.insert(0, str(HERE))
    from cppo.config import CPPOConfig
    from cppo.trainer import train
    prompts = Path(values.get("dataset_name", ""))
    if prompts.suffix == ".jsonl" and not prompts.exists():   # real shape: its prompts as rows
        rows = json.loads((prompts.parent / "prompts.json").read_text())
        prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train(CPPOConfig(**values))


def measure(values: dict, warm: int) -> dict:
    """Run one row in its own process; its steady seconds per step and phase means."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(HERE), str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, __file__, "--worker", json.dumps(values)], env=env,
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"row failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    out = Path(values["output_dir"])
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    steps = [r for r in rows if "loss" in r]
    counted = steps[warm:]
    seconds = (counted[-1]["wall_time"] - steps[warm - 1]["wall_time"]) / len(counted)
    mean = lambda key: statistics.fmean(r.get(key, 0.0) for r in counted)   # noqa: E731
    summary = json.loads((out / "summary.json").read_text())
    evals = [r for r in rows if "accuracy" in r or "eval_accuracy" in r]
    return {"seconds_per_step": seconds, "wait_s": mean("timing/generate"),
            "generate_s": mean("rollout/duration_s"), "train_s": seconds - mean("timing/generate"),
            "staleness_mean": mean("sample/staleness_mean"),
            "dropped_stale": counted[-1].get("sample/dropped_stale_total", 0.0),
            "weight_sync_s": mean("perf/weight_sync_s"),
            "questions_per_step": summary.get("questions_per_step"),
            "accuracy": summary.get("accuracy_after"), "evaluations": evals}


def bound(sync: dict) -> tuple[float, float]:
    """Generation share of a synchronous step (the generator's sampling seconds per round over
    the step) and the overlap bound 1 / max(generation share, training share): a step cannot
    take less than either side's own time."""
    share = sync["generate_s"] / sync["seconds_per_step"]
    return share, sync["seconds_per_step"] / max(sync["generate_s"], sync["train_s"])


def simulate(generate_s: float, train_s: float, sync_s: float, devices: int, staleness: int,
             steps: int = 200) -> float:
    """Seconds per step of a split with `devices` generation and `devices` training devices: each
    side's measured time divided by them, the weight push (sync_s) not; generation runs up to
    `staleness` rounds ahead of training (0: lockstep)."""
    gen, trn = generate_s / devices, train_s / devices + sync_s
    if staleness == 0:
        return gen + trn
    sampled, trained = [], []
    for i in range(steps):   # round i starts once round i - staleness - 1 has trained
        start = sampled[-1] if sampled else 0.0
        if i > staleness:
            start = max(start, trained[i - staleness - 1])
        sampled.append(start + gen)
        trained.append(max(trained[-1] if trained else 0.0, sampled[-1]) + trn)
    return trained[-1] / steps


def speed_rows(models: list[str], real: str) -> list[dict]:
    rows = []
    for model in models:
        steps, warm = STEPS[model]
        for algorithm in ALGORITHMS:
            measured = {}
            for mode, staleness in MODES.items():
                out = Path(tempfile.mkdtemp(prefix="cppo_async_"))
                values = run_config(model, real, algorithm, staleness, 42, steps, out)
                measured[mode] = measure(values, warm)
                print(f"{model} {algorithm} {mode}: {measured[mode]['seconds_per_step']:.3f} s/step",
                      flush=True)
            share, limit = bound(measured["sync"])
            for mode, m in measured.items():
                speedup = measured["sync"]["seconds_per_step"] / m["seconds_per_step"]
                rows.append({"model": model, "algorithm": algorithm, "mode": mode, **m,
                             "seconds_per_question": m["seconds_per_step"] / m["questions_per_step"],
                             "speedup": speedup, "generation_share": share, "bound": limit,
                             "of_bound": speedup / limit})
    return rows


def accuracy_rows() -> list[dict]:
    rows = []
    for algorithm in ALGORITHMS:
        for mode, staleness in MODES.items():
            for seed in SEEDS:
                out = Path(tempfile.mkdtemp(prefix="cppo_async_acc_"))
                values = run_config("embedded", "", algorithm, staleness, seed, ACCURACY_STEPS,
                                    out)   # held-out accuracy before and after
                m = measure(values, warm=4)
                rows.append({"algorithm": algorithm, "mode": mode, "seed": seed,
                             "accuracy": m["accuracy"], "wall_s": m["seconds_per_step"] * ACCURACY_STEPS})
                print(f"accuracy {algorithm} {mode} seed {seed}: {m['accuracy']}", flush=True)
    return rows


def write(result: dict) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "results.json").write_text(json.dumps(result, indent=1))
    lines = [f"# Asynchronous rollouts on split hardware (trainer: core 0, generator: core 1)\n",
             f"CPU: {result['cpu']}, torch capability {result['capability']}; command: "
             f"`{result['command']}`; {result['date']}.\n",
             "| model | algorithm | mode | s/step | s/question | speed-up | bound | of bound | "
             "staleness | dropped |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["speed"]:
        lines.append(f"| {r['model']} | {r['algorithm']} | {r['mode']} | {r['seconds_per_step']:.3f} "
                     f"| {r['seconds_per_question']:.4f} | {r['speedup']:.2f}x | {r['bound']:.2f}x "
                     f"| {100 * r['of_bound']:.0f} % | {r['staleness_mean']:.2f} | "
                     f"{r['dropped_stale']:.0f} |")
    lines += ["", "bound: the sync row's step over the longer of its two sides (the generator's "
              "sampling seconds per round; the trainer's step less its wait for the round); "
              "'of bound' is the speed-up over it. s/question: per training question (CPPO "
              "samples 4x GRPO's questions per step at the embedded default's P = 0.75, 8x at "
              "the real shape's P = 0.875). staleness: the trained rounds' mean; short runs "
              "(the real shape's 6 steps) end before the generator is max_staleness rounds "
              "ahead. Real shape: real_shape.py's model (--real quick: 4 layers, 32k "
              "vocabulary, G = 8, 64 new tokens; generation from a bfloat16 copy).", ""]
    if result.get("projection"):
        lines += ["## Projection (simulator fed with the sync rows' phase times)", "",
                  "| model | algorithm | split | sync s/step | async S=2 s/step | speed-up |",
                  "|---|---|---|---|---|---|"]
        for p in result["projection"]:
            lines.append(f"| {p['model']} | {p['algorithm']} | {p['split']} | {p['sync']:.3f} | "
                         f"{p['async']:.3f} | {p['sync'] / p['async']:.2f}x |")
        lines.append("")
    if result.get("accuracy"):
        lines += [f"## Held-out greedy accuracy after {ACCURACY_STEPS} steps (embedded default, "
                  f"seeds {', '.join(map(str, SEEDS))}; `{result.get('accuracy_command')}`)", "",
                  "Equal steps are equal training questions within an algorithm; the wall "
                  "seconds are each run's training rounds at the measured rate.", "",
                  "| algorithm | mode | accuracy (mean) | per seed | wall s (mean) |",
                  "|---|---|---|---|---|"]
        groups = {}
        for r in result["accuracy"]:
            groups.setdefault((r["algorithm"], r["mode"]), []).append(r)
        for (algorithm, mode), rs in groups.items():
            accs = [r["accuracy"] for r in rs]
            lines.append(f"| {algorithm} | {mode} | {100 * statistics.fmean(accs):.1f} % | "
                         f"{', '.join(f'{100 * a:.1f}' for a in accs)} | "
                         f"{statistics.fmean(r['wall_s'] for r in rs):.0f} |")
    (OUT / "results.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["embedded", "real"],
                        choices=["embedded", "real"])
    parser.add_argument("--real", default="full", choices=["full", "quick"])
    parser.add_argument("--accuracy", action="store_true")
    parser.add_argument("--render", action="store_true", help="rewrite results.md from results.json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(json.loads(args.worker))
    if args.render:
        return write(json.loads((OUT / "results.json").read_text()))
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("needs 2 cores (trainer on core 0, generator on core 1)")
    import torch
    if args.accuracy:   # added to the committed speed rows
        result = json.loads((OUT / "results.json").read_text())
        result["accuracy"] = accuracy_rows()
        result["accuracy_command"] = "python benchmarks/async_rollout.py --accuracy"
        write(result)
        return print((OUT / "results.md").read_text())
    result = {"cpu": cpu_model(), "capability": torch.backends.cpu.get_cpu_capability(),
              "command": "python benchmarks/async_rollout.py " + " ".join(sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d"), "speed": speed_rows(args.models, args.real)}
    result["projection"] = [
        {"model": r["model"], "algorithm": r["algorithm"], "split": f"{n}+{n}",
         "sync": simulate(r["generate_s"], r["train_s"] - r["weight_sync_s"], r["weight_sync_s"], n, 0),
         "async": simulate(r["generate_s"], r["train_s"] - r["weight_sync_s"], r["weight_sync_s"], n, 2)}
        for r in result["speed"] if r["mode"] == "sync" for n in (1, 4)]
    write(result)
    print((OUT / "results.md").read_text())


if __name__ == "__main__":
    main()
