"""Where metrics go: metrics.jsonl (always), TensorBoard (when asked for and installed), plots."""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path


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


class MetricsLog:
    """Appends one JSON object per line; mirrors scalars to TensorBoard when enabled."""

    def __init__(self, output_dir: str | Path, report_to: list[str]) -> None:
        self.path = Path(output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.writer = None
        if "tensorboard" in report_to:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.writer = SummaryWriter(str(Path(output_dir) / "tensorboard"))
            except ImportError:
                print("report_to has 'tensorboard' but tensorboard is not installed "
                      "(pip install 'cppo[tensorboard]'); logging to metrics.jsonl only")

    def log(self, record: dict) -> None:
        with self.path.open("a") as fh:
            fh.write(json.dumps(record) + "\n")
        if self.writer is not None:
            step = record.get("step", 0)
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self.writer.add_scalar(key, value, step)

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
        if self.writer is not None:
            self.writer.close()


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
