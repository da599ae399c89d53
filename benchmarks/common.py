"""What the benchmark programs share: the machine record, a trainer or a run's parts to time,
writing results, and ranges over repeats.

    from common import machine, machine_of, trainer_for, parts_for, write_results, read_results, spread

A program run as `python benchmarks/X.py` finds this module beside it. Nothing heavy is imported
here (headlines.py and the tests import it): torch and cppo only inside the functions that use them.
"""

from __future__ import annotations

import contextlib
import io
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


# ----------------------------------------------------------------- the machine record ---------
def machine(device: str = "cpu", env: dict | None = None, **extra) -> dict:
    """The machine a measurement ran on: cppo.parallel.hardware.describe(device) (CPU model as
    "cpu", architecture as "machine", torch, CPU capability, torch threads, bf16 flags; "gpu" on
    cuda) with the cores, Python version and platform, then `extra` (a program's own notes).
    With `env`, it is taken in a child process with that environment, as runs started with it
    see the machine (an emulated AVX2 limit shows in its capability)."""
    if env is not None:
        code = (f"import json, sys; sys.path.insert(0, {str(HERE)!r}); import common; "
                f"print(json.dumps(common.machine({device!r})))")
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, check=True).stdout
        return {**json.loads(out.strip().splitlines()[-1]), **extra}
    from cppo.parallel import hardware
    return {**hardware.describe(device), "cores": os.cpu_count(),
            "python": platform.python_version(), "platform": platform.platform(), **extra}


# older results files' names for machine()'s keys
OLD_KEYS = {"cpu_count": "cores", "torch_threads": "threads", "capability": "cpu_capability"}


def machine_of(data: dict) -> dict:
    """A results file's machine record in machine()'s shape, whatever shape its program wrote:
    `data["machine"]` or `data["meta"]["machine"]`, and the older ones: describe() nested under
    "hardware" (cppo_table), the CPU model in "cpu_model" beside the architecture in "cpu"
    (exit_codes, restarts), "cpu_count" / "torch_threads" for cores and threads, and
    async_rollout's top-level "cpu" and "capability"."""
    record = data.get("machine") or (data.get("meta") or {}).get("machine")
    if record is None:
        record = {k: data[k] for k in ("cpu", "capability") if k in data}
    record = dict(record)
    nested = record.pop("hardware", None)
    if isinstance(nested, dict):
        record = {**record, **nested}
    if "cpu_model" in record:
        record.setdefault("machine", record.get("cpu"))
        record["cpu"] = record.pop("cpu_model")
    for old, new in OLD_KEYS.items():
        if old in record:
            value = record.pop(old)
            record.setdefault(new, value)
    return record


# ----------------------------------------------------------------- a trainer to time ----------
def bench_config(model: str | None = None, *, prefix: str = "cppo_bench_", **fields):
    """CPPOConfig's defaults, then `fields` (strings are parsed as on the command line), the
    progress bar off and, unless `fields` name one, a new temporary output_dir (`prefix`).
    `model`: a model folder or name (None: the config's own)."""
    from cppo.config import CPPOConfig
    values = {"progress_bar": False, **fields}
    if "output_dir" not in values:
        values["output_dir"] = tempfile.mkdtemp(prefix=prefix)
    if model:
        values["model"] = model
    return CPPOConfig.load(overrides=values)


def trainer_for(model: str | None = None, rows: list[dict] | None = None, reward=None, *,
                quiet: bool = True, prefix: str = "cppo_bench_", **fields):
    """A CPPOTrainer to time, of bench_config(model, prefix=prefix, **fields). `rows` and
    `reward`: the training rows and the reward function (None: the config's task). quiet: the
    trainer's start-up prints are swallowed."""
    from cppo.trainer import CPPOTrainer
    data = {} if rows is None else {"train_dataset": rows}
    if reward is not None:
        data["reward_funcs"] = [reward]
    with contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext():
        return CPPOTrainer(args=bench_config(model, prefix=prefix, **fields), **data)


def parts_for(model: str | None = None, rows: list[dict] | None = None, reward=None, *,
              quiet: bool = True, prefix: str = "cppo_bench_", **fields):
    """The parts of a run to time (cppo.assembly.build_run), without a trainer around them: the
    same arguments as trainer_for."""
    from cppo.assembly import build_run
    data = {} if rows is None else {"train_dataset": rows}
    if reward is not None:
        data["reward_funcs"] = [reward]
    with contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext():
        return build_run(bench_config(model, prefix=prefix, **fields), **data)


def first_round_rows(parts) -> list[dict]:
    """The questions of a run's first round (one process, no skipping): as the trainer takes them."""
    return [parts.task.train_rows[i] for i in parts.questions.take(parts.plan.questions_per_step)]


# ----------------------------------------------------------------- runs of the main job ------
def sweep_options(parser, out: Path, seeds=(42, 1, 2)) -> None:
    """The options of a program that runs the README's main job over seeds: --seeds,
    --max_steps, --resume (keep the rows already written) and --out."""
    parser.add_argument("--seeds", nargs="+", type=int, default=list(seeds))
    parser.add_argument("--max_steps", type=int, default=600, help="optimizer steps (600: the default run)")
    parser.add_argument("--resume", action="store_true", help="keep the rows already in the results")
    parser.add_argument("--out", default=str(out), help="where results.json and results.md go")


def earlier_rows(args, **same) -> list[dict]:
    """With --resume, the rows already in args.out when it was written with these max_steps
    and `same` values (what the rows' numbers depend on); [] otherwise."""
    old = read_results(args.out) if args.resume else {}
    wanted = {"max_steps": args.max_steps, **same}
    return old.get("rows", []) if all(old.get(k) == v for k, v in wanted.items()) else []


def main_job_run(row: dict, run_dir: Path, **fields) -> tuple[dict, object]:
    """One in-process run of the README's main job changed by `fields` (no evaluations between,
    no checkpoints, a jsonl log in run_dir): `row` with the run's steps, held-out accuracy before
    and after, train and wall seconds and the load average when it started and ended; and the
    trainer."""
    start, load_start = time.perf_counter(), os.getloadavg()[0]
    trainer = trainer_for(eval_steps=0, save_steps=0, output_dir=str(run_dir),
                          report_to=["jsonl"], **fields)
    summary = trainer.train()
    return {**row, "steps": summary["steps"], "accuracy_before": summary["accuracy_before"],
            "accuracy_after": summary["accuracy_after"], "train_seconds": summary["train_seconds"],
            "wall_seconds": round(time.perf_counter() - start, 1),
            "load_average": [round(load_start, 2), round(os.getloadavg()[0], 2)]}, trainer


def accuracy_cells(runs: list[dict]) -> str:
    """A table row's cells for runs over seeds: held-out accuracy before -> after (means), the
    gain in points and the train seconds, each median (min to max)."""
    gain = spread([100 * (r["accuracy_after"] - r["accuracy_before"]) for r in runs], digits=1)
    secs = spread([r["train_seconds"] for r in runs], digits=0)
    before = statistics.mean(r["accuracy_before"] for r in runs)
    after = statistics.mean(r["accuracy_after"] for r in runs)
    return (f"{100 * before:.1f} % -> {100 * after:.1f} % "
            f"| {gain['median']:+.1f} ({gain['min']:+.1f} to {gain['max']:+.1f}) "
            f"| {secs['median']:.0f} ({secs['min']:.0f}-{secs['max']:.0f})")


# ----------------------------------------------------------------- results files --------------
def read_results(out: Path | str, name: str = "results.json") -> dict:
    """What an earlier run wrote to out/name ({} when there is none): rows a program keeps."""
    path = Path(out) / name
    return json.loads(path.read_text()) if path.is_file() else {}


def write_results(out: Path | str, data: dict | None, markdown: list[str] | str | None, *,
                  indent: int = 2, json_name: str = "results.json", md_name: str = "results.md",
                  echo: bool = True) -> list[Path]:
    """Write `data` to out/results.json and `markdown` (lines, each ending with a newline, or one
    text, written as it is) to out/results.md, creating `out`; None leaves that file out. The
    Markdown is printed unless `echo` is False. Returns the paths written."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    if data is not None:
        written.append(out / json_name)
        written[-1].write_text(json.dumps(data, indent=indent, default=str) + "\n")
    if markdown is not None:
        text = markdown if isinstance(markdown, str) else "\n".join(markdown) + "\n"
        written.append(out / md_name)
        written[-1].write_text(text)
        if echo:
            print(text.rstrip("\n"))
    return written


# ----------------------------------------------------------------- ranges over repeats --------
def spread(values, scale: float = 1.0, digits: int | None = None) -> dict:
    """{"median", "min", "max"} of a measurement's repeats, each times `scale` (1000: seconds to
    ms) and rounded to `digits` (None: not rounded)."""
    values = [v * scale for v in values]
    out = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return out if digits is None else {k: round(v, digits) for k, v in out.items()}


def spread_text(median, low, high, digits: int | None = None, range_digits: int | None = None,
                brackets: str = "()", sep: str = "-") -> str:
    """'1.23 (1.10-1.40)': a median and, in `brackets`, the range of the repeats; `digits` (and
    `range_digits`, default `digits`) decimals, None: the numbers as they print."""
    def text(v, d):
        return str(v) if d is None else f"{v:.{d}f}"
    rd = digits if range_digits is None else range_digits
    return f"{text(median, digits)} {brackets[0]}{text(low, rd)}{sep}{text(high, rd)}{brackets[1]}"
