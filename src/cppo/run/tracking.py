"""Where metrics go: metrics.jsonl (always), the trackers named in `report_to` through their own
libraries (TensorBoard, Weights & Biases offline, trackio local), plots; and the logging window
that averages each metric over the steps between two logging steps, as TRL does.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING
from cppo.errors import ConfigError


if TYPE_CHECKING:
    import torch

# report_to name -> (module that must be importable, pip extra that installs it)
TRACKERS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "trackio": ("trackio", "trackio"),
}
REPORT_TO_CHOICES = ("jsonl", *TRACKERS, "none", "all")


def installed(name: str) -> bool:
    return importlib.util.find_spec(TRACKERS[name][0]) is not None


def resolve_report_to(report_to: list[str] | str) -> list[str]:
    """The trackers a run reports to, as in transformers: 'none' -> none, 'all' -> every installed
    tracker; 'jsonl' (metrics.jsonl, always written) is dropped. Unknown names raise ConfigError."""
    names = [report_to] if isinstance(report_to, str) else list(report_to)
    for name in names:
        if name not in REPORT_TO_CHOICES:
            raise ConfigError(f"'report_to' has {name!r}; allowed: {', '.join(REPORT_TO_CHOICES)}")
    if "none" in names:
        if len(names) > 1:
            raise ConfigError(f"'report_to' is {names}; 'none' cannot be combined with other names")
        return []
    if "all" in names:
        return [name for name in TRACKERS if installed(name)]
    return [name for name in dict.fromkeys(names) if name != "jsonl"]


def check_report_to(report_to: list[str] | str) -> None:
    """Raise ConfigError, naming the extra to install, for a tracker whose library is missing."""
    for name in resolve_report_to(report_to):
        module, extra = TRACKERS[name]
        if not installed(name):
            raise ConfigError(f"'report_to' has {name!r} but the {module!r} package is not "
                              f"installed; install it with `pip install 'cppo[{extra}]'`")


def length_metrics(lengths: torch.Tensor, truncated: torch.Tensor) -> dict[str, float]:
    """TRL's completions/* metrics of one step: lengths (N,) in tokens, truncated (N,) bool
    (no EOS). Terminated lengths are over completions that ended with EOS (0 when none did)."""
    terminated = lengths[~truncated.to(lengths.device)]
    if terminated.numel() == 0:
        terminated = lengths.new_zeros(1)
    return {"completions/mean_length": float(lengths.mean()),
            "completions/min_length": float(lengths.min()),
            "completions/max_length": float(lengths.max()),
            "completions/clipped_ratio": float(truncated.float().mean()),
            "completions/mean_terminated_length": float(terminated.mean()),
            "completions/min_terminated_length": float(terminated.min()),
            "completions/max_terminated_length": float(terminated.max())}


class PhaseTimer:
    """Accumulates wall time per phase (generate, score, logprobs, update, eval, checkpoint)."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self.last: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            took = time.perf_counter() - start
            self.last[phase] = self.last.get(phase, 0.0) + took
            self.totals[phase] = self.totals.get(phase, 0.0) + took

    def pop_last(self) -> dict[str, float]:
        last, self.last = self.last, {}
        return last


class MetricsWindow:
    """The values of each metric since the last logging step; `flush` returns their means (NaN
    values skipped) and starts a new window, as TRL averages its metrics between two logs. Keys in
    `latest` keep their last value instead (the learning rate at the logging step, as transformers
    logs it)."""

    latest = ("learning_rate",)

    def __init__(self) -> None:
        self.values: dict[str, list[float]] = {}

    def add(self, metrics: dict) -> None:
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.values.setdefault(key, []).append(float(value))

    def flush(self) -> dict[str, float]:
        out = {}
        for key, values in self.values.items():
            finite = [v for v in values if not math.isnan(v)]
            if key in self.latest:
                out[key] = values[-1]
            else:
                out[key] = sum(finite) / len(finite) if finite else math.nan
        self.values = {}
        return out


class TensorBoardTracker:
    """TensorBoard event files under <output_dir>/tensorboard; `values` (the run's settings)
    shown as a text panel named config."""

    def __init__(self, output_dir: Path, values: dict | None, run_name: str | None) -> None:
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(str(output_dir / "tensorboard"))
        if values:
            self.writer.add_text("config", "\n".join(f"    {k}: {v}" for k, v in values.items()))

    def log(self, scalars: dict[str, float], step: int) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)

    def log_table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        header = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"
        body = "".join("| " + " | ".join(_cell(v) for v in row) + " |\n" for row in rows)
        self.writer.add_text(name, header + body, step)

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """Weights & Biases; offline (files under <output_dir>/wandb, `wandb sync` uploads them) unless
    WANDB_MODE says otherwise. Project from WANDB_PROJECT (default 'cppo')."""

    def __init__(self, output_dir: Path, values: dict | None, run_name: str | None) -> None:
        os.environ.setdefault("WANDB_MODE", "offline")
        import wandb
        self.wandb = wandb
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "cppo"), name=run_name,
                              dir=str(output_dir), config=values or {})

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def log_table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        self.run.log({name: self.wandb.Table(columns=columns, data=rows)}, step=step)

    def close(self) -> None:
        self.run.finish()


class TrackioTracker:
    """trackio: a local SQLite store (TRACKIO_DIR, default ~/.cache/huggingface/trackio; `trackio
    show` opens its dashboard). Project from TRACKIO_PROJECT (default 'cppo'); TRACKIO_SPACE_ID, if
    set, also syncs to that Hugging Face Space."""

    def __init__(self, output_dir: Path, values: dict | None, run_name: str | None) -> None:
        import trackio
        self.trackio = trackio
        self.run = trackio.init(project=os.environ.get("TRACKIO_PROJECT", "cppo"), name=run_name,
                                config=values or {}, space_id=os.environ.get("TRACKIO_SPACE_ID"))

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.trackio.log(scalars, step=step)

    def log_table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        import pandas as pd
        self.trackio.log({name: self.trackio.Table(dataframe=pd.DataFrame(rows, columns=columns))},
                         step=step)

    def close(self) -> None:
        self.trackio.finish()


TRACKER_CLASSES = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker,
                   "trackio": TrackioTracker}


def _cell(value) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


class MetricsLog:
    """Appends one JSON object per line to metrics.jsonl and sends the numbers to the trackers
    named in report_to (values: the run's settings as a plain dict, shown by the trackers)."""

    def __init__(self, output_dir: str | Path, report_to: list[str], values: dict | None = None,
                 run_name: str | None = None) -> None:
        self.path = Path(output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        check_report_to(report_to)
        self.trackers = {}
        for name in resolve_report_to(report_to):
            self.trackers[name] = TRACKER_CLASSES[name](Path(output_dir), values, run_name)

    def log(self, record: dict) -> None:
        with self.path.open("a") as fh:
            fh.write(json.dumps(record) + "\n")
        step = int(record.get("step", 0))
        scalars = {k: v for k, v in record.items() if k != "step" and not isinstance(v, bool)
                   and isinstance(v, (int, float)) and math.isfinite(v)}
        for tracker in self.trackers.values():
            tracker.log(scalars, step)

    def log_table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        """A table (e.g. sample completions) to every tracker: a wandb/trackio Table, a
        TensorBoard text panel."""
        for tracker in self.trackers.values():
            tracker.log_table(name, columns, rows, step)

    def reset(self) -> None:
        self.path.write_text("")

    def read(self) -> list[dict]:
        if not self.path.is_file():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def truncate_after(self, step: int) -> None:
        """On resume: drop records of steps after the checkpoint (they will be redone)."""
        kept = [r for r in self.read() if r.get("step", 0) <= step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def close(self) -> None:
        for tracker in self.trackers.values():
            tracker.close()
        self.trackers = {}


def write_plots(records: list[dict], output_dir: str | Path) -> list[Path]:
    """PNG plots of reward and held-out accuracy against wall time."""
    import matplotlib
    matplotlib.use("Agg")

    output_dir = Path(output_dir)
    written = []
    train = [r for r in records if "reward" in r]
    evals = [r for r in records if "eval/accuracy" in r]
    if train:
        written.append(_line_plot(
            [r["wall_time"] for r in train], [r["reward"] for r in train], "-",
            "mean reward (scored completions)", "Training reward", output_dir / "reward.png"))
    if evals:
        written.append(_line_plot(
            [r["wall_time"] for r in evals], [100 * r["eval/accuracy"] for r in evals], "o-",
            "held-out greedy accuracy (%)", "Held-out accuracy", output_dir / "accuracy.png"))
    return written


def _line_plot(xs, ys, style: str, ylabel: str, title: str, path: Path) -> Path:
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, ys, style, lw=1)
    ax.set(xlabel="wall time (s)", ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
