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
`--equal-wall` gives each asynchronous row (max_staleness 2) the wall time its synchronous row
took for ACCURACY_STEPS steps, and `--auto` gives `pruning_rate: auto` the wall time CPPO at the
fixed P took (embedded default, 3 seeds, held-out accuracy every EVAL_EVERY steps): accuracy at
equal wall time and the wall time to a target accuracy. The wall time is the run's training
rounds (summary train_seconds, which leaves out the evaluations and checkpoints) after its first
round (the generator's start-up); a run gets an equal budget through its max_steps, from the
seconds per step a run of the same config measured (so its learning-rate schedule ends where
its budget does).
A projection feeds the measured phase times to a simulator of 1+1, 4+4 and 8+8 device splits
(`--project` recomputes it from the committed rows). `--scale` runs 2 training processes
(torchrun) with one generator process and with two (generator_processes: 2).

    python benchmarks/async_rollout.py                       # embedded default and real shape
    python benchmarks/async_rollout.py --accuracy              # + held-out accuracy, 3 seeds
    python benchmarks/async_rollout.py --equal-wall --auto     # + accuracy at equal wall time
    python benchmarks/async_rollout.py --real quick          # the small real-shape model
    python benchmarks/async_rollout.py --models embedded real --real quick --repeats 3
    python benchmarks/async_rollout.py --models real --real full --staleness 2   # rows added
    python benchmarks/async_rollout.py --accuracy --staleness 8 16             # rows added
    python benchmarks/async_rollout.py --scale --repeats 3     # 2 trainers x 1 or 2 generators
    python benchmarks/async_rollout.py --project               # the projection, no runs

Writes benchmarks/results/async_rollout/results.md and results.json (--out: elsewhere); each
mode replaces its own sections and keeps the others; speed rows replace those of the models run
(labelled 'embedded', 'real quick', 'real full'), accuracy rows those of the modes run.
`--repeats N` runs each speed row N times, the modes interleaved, and reports the median run with
the range of its speed-ups.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import machine, machine_of, read_results, spread, write_results

HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "async_rollout"
MODES = {"sync": 0, "async S=1": 1, "async S=2": 2, "async S=4": 4}
ALGORITHMS = {"GRPO": 0.0, "CPPO": None}   # None: the model's CPPO pruning rate
STEPS = {"embedded": (40, 5), "real": (6, 2)}   # (steps run, first steps not counted)
ACCURACY_STEPS, SEEDS = 150, (42, 1, 2)
EVAL_EVERY, EQUAL_WALL_STALENESS = 10, 2   # --equal-wall and --auto
WALL_NOTE = ("Wall time: a run's training rounds after its first (summary train_seconds less "
             "the first round, which waits for the generator's start-up; evaluations and "
             "checkpoints are not in it). The budget and the seconds per step come from runs "
             "without evaluations; wall s is the reported run's own, with its evaluations, "
             "during which an asynchronous generator keeps sampling ahead, so it may come in "
             "under the budget.")
TARGET_SHARE = 0.95   # --auto's default target: this share of the fixed-P runs' final accuracy


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
        values.update(real_shape.cppo_fields(shape, values.get("pruning_rate",
                                                                real_shape.CPPO_PRUNING)),
                      model=str(folder), dataset_name=str(folder / "prompts.jsonl"),
                      reward_funcs=["real_shape:shorter_is_better"],
                      generation_dtype="bfloat16", matmul_dtype=None, eval_steps=0)
    return values


def worker(values: dict) -> None:
    """One row in this process: the trainer on core 0 (or values' trainer_cpus) with one thread."""
    os.sched_setaffinity(0, set(values.pop("trainer_cpus", [0])))
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


def measure(values: dict, warm: int, trainers: int = 1) -> dict:
    """Run one row in its own process (trainers > 1: that many under torchrun, each on core 0);
    its steady seconds per step and phase means."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(HERE), str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")]))
    launch = [sys.executable]
    if trainers > 1:
        from cppo.parallel.processes import free_port
        env["OMP_NUM_THREADS"] = "1"
        launch += ["-m", "torch.distributed.run", "--nproc_per_node", str(trainers),
                   "--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    done = subprocess.run([*launch, __file__, "--worker", json.dumps(values)], env=env,
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


def first_round_seconds(out: Path) -> float:
    """The first round's phases (the generator's start-up is in its wait), from metrics.jsonl."""
    first = next(json.loads(line) for line in open(out / "metrics.jsonl") if '"loss"' in line)
    return sum(v for k, v in first.items() if k.startswith("timing/"))


def clocked(values: dict, cache: dict) -> dict:
    """Run one config (once per cache: the same values give the same row) and read its clock:
    training-round seconds after the first round, at the end and at each evaluation."""
    key = json.dumps({k: v for k, v in values.items() if k != "output_dir"}, sort_keys=True)
    if key in cache:
        return cache[key]
    measure(values, warm=1)
    out = Path(values["output_dir"])
    summary = json.loads((out / "summary.json").read_text())
    start = first_round_seconds(out)
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    rates = [r["cppo/pruning_rate"] for r in records if "cppo/pruning_rate" in r]
    kept = [r["cppo/completions_kept"] for r in records if "cppo/completions_kept" in r]
    cache[key] = {"steps": summary["steps"], "accuracy": summary["accuracy_after"],
                  "clock_s": summary["train_seconds"] - start,
                  "seconds_per_step": (summary["train_seconds"] - start) / max(1, summary["steps"] - 1),
                  "evaluations": [(h["step"], max(0.0, h["train_seconds"] - start), h["accuracy"])
                                  for h in summary["history"] if h["step"] > 0],
                  "pruning_rate_mean": statistics.fmean(rates) if rates else None,
                  "kept_mean": statistics.fmean(kept) if kept else None}
    return cache[key]


def steps_for(budget_s: float, seconds_per_step: float) -> int:
    """max_steps whose training rounds fill budget_s at seconds_per_step (the first round apart)."""
    return max(2, 1 + round(budget_s / seconds_per_step))


def unevaluated(values: dict, steps: int, cache: dict) -> dict:
    """`values` run for `steps` steps without held-out evaluations: the budgets and seconds per
    step come from these (while an asynchronous trainer evaluates, its generator samples the
    next rounds, time the clock leaves out)."""
    return clocked({**values, "eval_steps": 0, "max_steps": steps,
                    "output_dir": tempfile.mkdtemp(prefix="cppo_async_pilot_")}, cache)


def equal_wall_run(values: dict, budget_s: float, steps: int, cache: dict) -> dict:
    """`values` run for `budget_s` of training rounds: a run of `steps` steps without
    evaluations measures its seconds per step, then the run itself takes as many steps as fill
    the budget."""
    pilot = unevaluated(values, steps, cache)
    run = clocked({**values, "max_steps": steps_for(budget_s, pilot["seconds_per_step"])}, cache)
    return {**run, "budget_s": budget_s}


def time_to(target: float, run: dict) -> float | None:
    """The clock at the first evaluation at or above `target` (None: never reached)."""
    return next((clock for _, clock, acc in run["evaluations"] if acc >= target), None)


def wall_values(algorithm: str, staleness: int, seed: int, steps: int, **extra) -> dict:
    """One run's config, held-out accuracy every EVAL_EVERY steps, in a new folder."""
    values = run_config("embedded", "", algorithm, staleness, seed, steps,
                        Path(tempfile.mkdtemp(prefix="cppo_async_acc_")), eval_steps=EVAL_EVERY)
    return {**values, **extra}


def equal_wall_rows(steps: int, seeds, cache: dict) -> list[dict]:
    """Per algorithm and seed: sync for `steps` steps, and async (max_staleness 2) for the same
    wall time."""
    rows = []
    for algorithm in ALGORITHMS:
        for seed in seeds:
            sync = wall_values(algorithm, 0, seed, steps)
            budget = unevaluated(sync, steps, cache)["clock_s"]
            runs = {"sync": {**clocked(sync, cache), "budget_s": budget},
                    f"async S={EQUAL_WALL_STALENESS}": equal_wall_run(
                        wall_values(algorithm, EQUAL_WALL_STALENESS, seed, steps), budget, steps,
                        cache)}
            for mode, run in runs.items():
                rows.append({"algorithm": algorithm, "mode": mode, "seed": seed, **run})
                print(f"equal wall {algorithm} {mode} seed {seed}: {run['accuracy']} after "
                      f"{run['steps']} steps, {run['clock_s']:.1f} s", flush=True)
    return rows


def auto_rows(steps: int, seeds, cache: dict) -> list[dict]:
    """Per seed: CPPO at the embedded default's P (async, max_staleness 2) for `steps` steps, and
    pruning_rate auto for the same wall time."""
    rows = []
    for seed in seeds:
        values = wall_values("CPPO", EQUAL_WALL_STALENESS, seed, steps)
        budget = unevaluated(values, steps, cache)["clock_s"]
        fixed = {**clocked(values, cache), "budget_s": budget}
        auto = equal_wall_run({**values, "pruning_rate": "auto"}, budget, steps, cache)
        for arm, run in (("fixed P", fixed), ("auto", auto)):
            rows.append({"arm": arm, "seed": seed, **run})
            print(f"auto: {arm} seed {seed}: {run['accuracy']} after {run['steps']} steps, "
                  f"{run['clock_s']:.1f} s, mean P {run['pruning_rate_mean']}", flush=True)
    return rows


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


SPLITS = (1, 4, 8)   # the projection's generation + training device splits (n + n)


def projection_rows(speed: list[dict], splits=SPLITS) -> list[dict]:
    """The simulator fed with each sync row's phase times (its generator's sampling seconds per
    round, its trainer's step less its wait and push, the push): seconds per step of an n + n
    split, synchronous and at max_staleness 2, and the split's overlap bound (sync over the
    longer side)."""
    rows = []
    for r in (r for r in speed if r["mode"] == "sync"):
        gen, trn, push = r["generate_s"], r["train_s"] - r["weight_sync_s"], r["weight_sync_s"]
        for n in splits:
            sync = simulate(gen, trn, push, n, 0)
            rows.append({"model": r["model"], "algorithm": r["algorithm"], "split": f"{n}+{n}",
                         "sync": sync, "async": simulate(gen, trn, push, n, 2),
                         "bound": sync / max(gen / n, trn / n + push)})
    return rows


def median_run(runs: list[dict]) -> dict:
    return sorted(runs, key=lambda m: m["seconds_per_step"])[len(runs) // 2]


def speed_rows(models: list[str], reals: list[str], repeats: int = 1,
               modes: dict = MODES) -> list[dict]:
    """Each row run `repeats` times, the modes interleaved (the machine's drift spreads over
    all of them); a row reports its median run, the median speed-up over the sync run of the
    same repeat and the range of those speed-ups and of their share of that repeat's bound.
    Rows are labelled 'embedded' or 'real <shape>'."""
    rows = []
    for model, real in [(m, r) for m in models for r in (reals if m == "real" else [""])]:
        steps, warm = STEPS[model]
        label = f"{model} {real}".strip()
        for algorithm in ALGORITHMS:
            runs = {mode: [] for mode in modes}
            for _ in range(repeats):
                for mode, staleness in modes.items():
                    out = Path(tempfile.mkdtemp(prefix="cppo_async_"))
                    values = run_config(model, real, algorithm, staleness, 42, steps, out)
                    runs[mode].append(measure(values, warm))
                    print(f"{label} {algorithm} {mode}: "
                          f"{runs[mode][-1]['seconds_per_step']:.3f} s/step", flush=True)
            share, limit = bound(median_run(runs["sync"]))
            limits = [bound(sync)[1] for sync in runs["sync"]]
            for mode, measured in runs.items():
                speedups = [sync["seconds_per_step"] / m["seconds_per_step"]
                            for sync, m in zip(runs["sync"], measured)]
                shares = spread([up / lim for up, lim in zip(speedups, limits)])
                m, speedups = median_run(measured), spread(speedups)
                rows.append({"model": label, "algorithm": algorithm, "mode": mode, **m,
                             "seconds_per_question": m["seconds_per_step"] / m["questions_per_step"],
                             "speedup": speedups["median"], "generation_share": share,
                             "bound": limit, "of_bound": shares["median"], "repeats": repeats,
                             "speedup_range": [speedups["min"], speedups["max"]],
                             "of_bound_range": [shares["min"], shares["max"]]})
    return rows


SCALE_MODES = {"sync": (1, 0), "async S=2": (1, 2), "async S=2, 2 generators": (2, 2)}


def scale_rows(repeats: int = 1) -> list[dict]:
    """2 training processes (torchrun, ddp) with one generator process or two
    (generator_processes), all on this machine's 2 cores as the OS schedules them, embedded
    default: each mode run `repeats` times,
    interleaved; the median run and the range of its speed-up over the same repeat's sync run."""
    steps, warm = STEPS["embedded"]
    rows = []
    for algorithm in ALGORITHMS:
        runs = {mode: [] for mode in SCALE_MODES}
        for _ in range(repeats):
            for mode, (generators, staleness) in SCALE_MODES.items():
                out = Path(tempfile.mkdtemp(prefix="cppo_async_scale_"))
                # 2 trainers and 1 or 2 generators on 2 cores: left to the OS's scheduler (a
                # generator process needs a core of its own in generator_cpus)
                values = {**run_config("embedded", "", algorithm, staleness, 42, steps, out),
                          "generator_processes": generators, "generator_cpus": None,
                          "trainer_cpus": [0, 1]}
                runs[mode].append(measure(values, warm, trainers=2))
                print(f"2 trainers {algorithm} {mode}: "
                      f"{runs[mode][-1]['seconds_per_step']:.3f} s/step", flush=True)
        for mode, measured in runs.items():
            speedups = spread([sync["seconds_per_step"] / m["seconds_per_step"]
                               for sync, m in zip(runs["sync"], measured)])
            m = median_run(measured)
            questions = 2 * m["questions_per_step"]   # questions_per_step: each process's
            rows.append({"algorithm": algorithm, "mode": mode, "trainers": 2,
                         "generators": SCALE_MODES[mode][0], **m,
                         "seconds_per_question": m["seconds_per_step"] / questions,
                         "speedup": speedups["median"], "repeats": repeats,
                         "speedup_range": [speedups["min"], speedups["max"]]})
    return rows


def scale_section(result: dict) -> list[str]:
    if not result.get("scale"):
        return []
    sc = result["scale"]
    lines = ["", f"## Two trainers x one or two generators (embedded default; `{sc['command']}`; "
             f"{sc['date']})", "",
             "2 training processes under torchrun (ddp, one thread each) and one or two "
             "generator processes (generator_processes, one thread each) on this machine's 2 "
             "cores, unpinned: 3 or 4 processes share 2 cores, so these rows show that the "
             "modes run and what sharing costs, not the speed-up of a device per process. "
             "s/question is per training question of both trainers.", "",
             "| algorithm | trainers x generators | mode | s/step | s/question | speed-up over "
             "sync | staleness | dropped |", "|---|---|---|---|---|---|---|---|"]
    for r in sc["rows"]:
        ranged = r.get("repeats", 1) > 1 and r["mode"] != "sync"
        up = f" ({r['speedup_range'][0]:.2f}-{r['speedup_range'][1]:.2f})" if ranged else ""
        lines.append(f"| {r['algorithm']} | {r['trainers']} x {r['generators']} | {r['mode']} | "
                     f"{r['seconds_per_step']:.3f} | {r['seconds_per_question']:.4f} | "
                     f"{r['speedup']:.2f}x{up} | {r['staleness_mean']:.2f} | "
                     f"{r['dropped_stale']:.0f} |")
    return lines


def staleness_of(mode: str) -> int:
    """A row's max_staleness from its mode's name ('sync': 0, 'async S=2': 2)."""
    return 0 if mode == "sync" else int(mode.rpartition("=")[2])


def accuracy_rows(modes: dict) -> list[dict]:
    """Held-out accuracy after ACCURACY_STEPS steps, per algorithm, mode ({name: staleness}) and
    seed."""
    rows = []
    for algorithm in ALGORITHMS:
        for mode, staleness in modes.items():
            for seed in SEEDS:
                out = Path(tempfile.mkdtemp(prefix="cppo_async_acc_"))
                values = run_config("embedded", "", algorithm, staleness, seed, ACCURACY_STEPS,
                                    out)   # held-out accuracy before and after
                m = measure(values, warm=4)
                rows.append({"algorithm": algorithm, "mode": mode, "seed": seed,
                             "accuracy": m["accuracy"], "wall_s": m["seconds_per_step"] * ACCURACY_STEPS})
                print(f"accuracy {algorithm} {mode} seed {seed}: {m['accuracy']}", flush=True)
    return rows


def write(result: dict, out: Path = OUT) -> None:
    repeats = max([r.get("repeats", 1) for r in result.get("speed", [])] or [1])
    m = machine_of(result)
    lines = [f"# Asynchronous rollouts on split hardware (trainer: core 0, generator: core 1)\n",
             f"CPU: {m.get('cpu')}, torch capability {m.get('cpu_capability')}; command: "
             f"{', '.join(f'`{c}`' for c in result.get('commands') or [result.get('command')])}; "
             f"{result.get('date')}.\n",
             "| model | algorithm | mode | s/step | s/question | speed-up | bound | of bound | "
             "staleness | dropped |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result.get("speed", []):
        ranged = r.get("repeats", 1) > 1 and r["mode"] != "sync"
        up = f" ({r['speedup_range'][0]:.2f}-{r['speedup_range'][1]:.2f})" if ranged else ""
        share = (f" ({100 * r['of_bound_range'][0]:.0f}-{100 * r['of_bound_range'][1]:.0f})"
                 if ranged else "")
        lines.append(f"| {r['model']} | {r['algorithm']} | {r['mode']} | {r['seconds_per_step']:.3f} "
                     f"| {r['seconds_per_question']:.4f} | {r['speedup']:.2f}x{up} | {r['bound']:.2f}x "
                     f"| {100 * r['of_bound']:.0f} %{share} | {r['staleness_mean']:.2f} | "
                     f"{r['dropped_stale']:.0f} |")
    lines += ["", "bound: the sync row's step over the longer of its two sides (the generator's "
              "sampling seconds per round; the trainer's step less its wait for the round); "
              "'of bound' is the speed-up over it. s/question: per training question (CPPO "
              "samples 4x GRPO's questions per step at the embedded default's P = 0.75, 8x at "
              "the real shape's P = 0.875). staleness: the trained rounds' mean; short runs "
              "(the real shape's 6 steps) end before the generator is max_staleness rounds "
              "ahead. Real shape: real_shape.py's model (--real quick: 4 layers, 32k "
              "vocabulary, G = 8, 64 new tokens; --real full: the 0.12B model, G = 16; "
              "generation from a bfloat16 copy)." + (
                  f" Rows with a range in brackets ran {repeats} times, the modes interleaved: "
                  f"s/step is the median run's, speed-up and 'of bound' the median of the "
                  f"speed-ups over the same repeat's sync run (their range in brackets); the "
                  f"others ran once." if repeats > 1 else ""), ""]
    if result.get("projection"):
        lines += ["## Projection (simulator fed with the sync rows' phase times)", "",
                  "| model | algorithm | split | sync s/step | async S=2 s/step | speed-up | "
                  "bound |", "|---|---|---|---|---|---|---|"]
        for p in result["projection"]:
            bound_text = f"{p['bound']:.2f}x" if "bound" in p else "n/a"
            lines.append(f"| {p['model']} | {p['algorithm']} | {p['split']} | {p['sync']:.3f} | "
                         f"{p['async']:.3f} | {p['sync'] / p['async']:.2f}x | {bound_text} |")
        lines += ["", "split n+n: n generation and n training devices, each side's measured "
                  "seconds divided by n (the same global batch spread over them), the push not; "
                  "bound: the split's synchronous step over its longer side. The real full rows "
                  "are the paper's GSM8K setting in shape (G = 16, P = 0.875: 8 questions and 16 "
                  "kept completions per step and training device; real_shape.py's 0.12B model, "
                  "timed on this CPU): its 8+8 row is the projection for 8 generation + 8 "
                  "training GPUs. A projection, not a measurement: on GPUs the two sides' shares "
                  "differ from this CPU's.", ""]
    if result.get("accuracy"):
        commands = ", ".join(f"`{c}`" for c in result.get("accuracy_commands")
                             or [result.get("accuracy_command")])
        lines += [f"## Held-out greedy accuracy after {ACCURACY_STEPS} steps (embedded default, "
                  f"seeds {', '.join(map(str, SEEDS))}; "
                  f"{commands})", "",
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
    lines += equal_wall_section(result) + auto_section(result) + scale_section(result)
    write_results(out, result, lines, indent=1, echo=False)


def mean_of(values) -> str:
    values = [v for v in values if v is not None]
    return f"{statistics.fmean(values):.1f}" if values else "n/a"


def per_seed(rows: list[dict]) -> str:
    return ", ".join(f"{100 * r['accuracy']:.1f}" for r in rows)


def grouped(rows: list[dict], *keys: str) -> dict:
    groups = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in keys), []).append(r)
    return groups


def equal_wall_section(result: dict) -> list[str]:
    if not result.get("equal_wall"):
        return []
    e = result["equal_wall"]
    lines = ["", f"## Held-out greedy accuracy at equal wall time (embedded default, seeds "
             f"{', '.join(map(str, e['seeds']))}; `{e['command']}`; {e['date']})", "",
             f"Each asynchronous run (max_staleness {EQUAL_WALL_STALENESS}) gets the wall time its "
             f"synchronous run took for {e['steps']} steps (budget): its max_steps is that time "
             f"over the seconds per step a {e['steps']}-step run of it measured. {WALL_NOTE} More "
             f"steps are more training questions.", "",
             "| algorithm | mode | accuracy (mean) | per seed | steps (mean) | budget s (mean) | "
             "wall s (mean) |", "|---|---|---|---|---|---|---|"]
    for (algorithm, mode), rs in grouped(e["rows"], "algorithm", "mode").items():
        lines.append(f"| {algorithm} | {mode} | {mean_of(100 * r['accuracy'] for r in rs)} % | "
                     f"{per_seed(rs)} | {statistics.fmean(r['steps'] for r in rs):.0f} | "
                     f"{statistics.fmean(r['budget_s'] for r in rs):.1f} | "
                     f"{statistics.fmean(r['clock_s'] for r in rs):.1f} |")
    return lines


def auto_section(result: dict) -> list[str]:
    if not result.get("auto"):
        return []
    a = result["auto"]
    target = a["target"]
    lines = ["", f"## pruning_rate: auto against the fixed P at equal wall time (embedded default, "
             f"async max_staleness {EQUAL_WALL_STALENESS}, seeds {', '.join(map(str, a['seeds']))}; "
             f"`{a['command']}`; {a['date']})", "",
             f"CPPO at the embedded default's P = 0.75 runs {a['steps']} steps; `pruning_rate: "
             f"auto` (rounds planned for pruning_rate_start 0.75, the rate within [0.5, 0.9375]) "
             f"gets the same wall time, through its max_steps from a {a['steps']}-step run of "
             f"it. Time to target: the wall time at the first held-out evaluation (every "
             f"{EVAL_EVERY} steps) at or above {100 * target:.1f} % ({a['target_rule']}), on the "
             f"run's wall time; 'reached' counts the runs that got there. {WALL_NOTE} auto's rate "
             f"depends on the measured timing, so its runs are not reproducible step for step.",
             "", "| arm | accuracy (mean) | per seed | steps (mean) | budget s (mean) | wall s "
             "(mean) | mean P | kept/step (mean) | time to target s (mean of reached) | reached |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for (arm,), rs in grouped(a["rows"], "arm").items():
        times = [time_to(target, r) for r in rs]
        rate = "0.75" if arm == "fixed P" else \
            f"{statistics.fmean(r['pruning_rate_mean'] for r in rs):.3f}"
        lines.append(f"| {arm} | {mean_of(100 * r['accuracy'] for r in rs)} % | "
                     f"{per_seed(rs)} | "
                     f"{statistics.fmean(r['steps'] for r in rs):.0f} | "
                     f"{statistics.fmean(r['budget_s'] for r in rs):.1f} | "
                     f"{statistics.fmean(r['clock_s'] for r in rs):.1f} | {rate} | "
                     f"{mean_of(r['kept_mean'] for r in rs)} | {mean_of(times)} | "
                     f"{sum(t is not None for t in times)}/{len(times)} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["embedded", "real"],
                        choices=["embedded", "real"])
    parser.add_argument("--real", nargs="+", default=["full"], choices=["full", "quick"])
    parser.add_argument("--accuracy", action="store_true")
    parser.add_argument("--staleness", type=int, nargs="+", default=None,
                        help="only these max_staleness values: with --accuracy, rows added "
                        "to the committed ones (e.g. 8 16: where staleness costs accuracy); for "
                        "speed rows, sync and these")
    parser.add_argument("--repeats", type=int, default=1,
                        help="speed rows: runs of each row, interleaved; the table gives the "
                        "median and the range of each speed-up")
    parser.add_argument("--equal-wall", action="store_true",
                        help="sync against async (max_staleness 2) at equal wall time")
    parser.add_argument("--auto", action="store_true",
                        help="pruning_rate auto against the fixed P at equal wall time")
    parser.add_argument("--steps", type=int, default=ACCURACY_STEPS,
                        help="--equal-wall / --auto: the reference runs' steps")
    parser.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    parser.add_argument("--target", type=float, default=None, help="--auto: the target accuracy "
                        f"(default: {TARGET_SHARE} x the fixed-P runs' mean final accuracy)")
    parser.add_argument("--out", type=Path, default=OUT, help="where results.json/.md go")
    parser.add_argument("--scale", action="store_true",
                        help="2 training processes (torchrun) with one or two generator processes")
    parser.add_argument("--project", action="store_true",
                        help="recompute the projection from the committed sync rows (no runs)")
    parser.add_argument("--render", action="store_true", help="rewrite results.md from results.json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(json.loads(args.worker))
    result = read_results(args.out)   # kept, section by section
    if args.render:
        return write(result, args.out)
    if args.project:
        result["projection"] = projection_rows(result.get("speed", []))
        write(result, args.out)
        return print((args.out / "results.md").read_text())
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("needs 2 cores (trainer on core 0, generator on core 1)")
    command = "python benchmarks/async_rollout.py " + " ".join(sys.argv[1:])
    if args.scale:   # added to the committed rows
        result["scale"] = {"rows": scale_rows(args.repeats), "command": command,
                           "date": time.strftime("%Y-%m-%d"), "machine": machine()}
        write(result, args.out)
        return print((args.out / "results.md").read_text())
    if args.accuracy or args.equal_wall or args.auto:   # added to the committed speed rows
        seeds, cache, today = [int(s) for s in args.seeds.split(",")], {}, time.strftime("%Y-%m-%d")
        if args.accuracy:   # the modes run now replace their rows; the others' stay
            modes = {f"async S={s}": s for s in args.staleness} if args.staleness else MODES
            kept = [r for r in result.get("accuracy", []) if r["mode"] not in modes]
            result["accuracy"] = sorted(kept + accuracy_rows(modes), key=lambda r: (
                list(ALGORITHMS).index(r["algorithm"]), staleness_of(r["mode"])))
            earlier = result.pop("accuracy_command", None)   # results written before commands
            result.setdefault("accuracy_commands", [earlier] if earlier else []).append(command)
        if args.equal_wall:
            result["equal_wall"] = {"rows": equal_wall_rows(args.steps, seeds, cache),
                                    "steps": args.steps, "seeds": seeds, "command": command,
                                    "date": today}
        if args.auto:
            rows = auto_rows(args.steps, seeds, cache)
            final = statistics.fmean(r["accuracy"] for r in rows if r["arm"] == "fixed P")
            rule = (f"{TARGET_SHARE} x the fixed-P runs' mean final accuracy"
                    if args.target is None else "given")
            result["auto"] = {"rows": rows, "steps": args.steps, "seeds": seeds,
                              "command": command, "date": today, "target_rule": rule,
                              "target": TARGET_SHARE * final if args.target is None else args.target}
        write(result, args.out)
        return print((args.out / "results.md").read_text())
    # the models run now replace their rows; the others' stay, with the commands that ran them
    modes = {"sync": 0, **{f"async S={s}": s for s in args.staleness}} if args.staleness \
        else MODES
    speed = speed_rows(args.models, args.real, args.repeats, modes)
    labels = {r["model"] for r in speed}
    earlier = [r for r in result.get("speed", []) if r["model"] not in labels]
    commands = [c for c in result.get("commands") or [result.get("command")]
                if c and earlier and c != command]
    result.update({"machine": machine(), "commands": [*commands, command],
                   "date": time.strftime("%Y-%m-%d"), "speed": earlier + speed})
    for old in ("command", "cpu", "capability"):   # the machine record's earlier shape
        result.pop(old, None)
    result["projection"] = [p for p in result.get("projection", []) if p["model"] not in labels] \
        + projection_rows(speed)
    write(result, args.out)
    print((args.out / "results.md").read_text())


if __name__ == "__main__":
    main()
