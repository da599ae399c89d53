"""accuracy_vs_time.png and speedup.png."""

from __future__ import annotations

import statistics
from pathlib import Path

from .rows import PAPER_SPEEDUP, PRUNING_RATES, all_rows
from .stats import by_seed, fair_stats, mean_std


def write_plots(raw: dict, stats: dict, output: Path) -> list[Path]:
    """Both figures into `output`; returns their paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return [_save(plt, plot_accuracy_vs_time(plt, raw, stats), output / "accuracy_vs_time.png"),
            _save(plt, plot_speedup(plt, raw, stats), output / "speedup.png")]


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_accuracy_vs_time(plt, raw: dict, stats: dict):
    """Held-out accuracy (mean over seeds) against training and wall seconds, one line per row."""
    runs, rows = raw["runs"], all_rows()
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    for name in (n for n in raw["settings"]["rows"] if n != "trl"):
        histories = [s["history"] for s in by_seed(runs, name).values()]
        if not histories:
            continue
        points = min(len(h) for h in histories)
        acc = [statistics.fmean(100 * h[i]["accuracy"] for h in histories) for i in range(points)]
        for ax, clock in zip(axes, ("train_seconds", "wall_time")):
            x = [statistics.fmean(h[i][clock] for h in histories) for i in range(points)]
            style = "-" if rows[name].kind in ("grpo", "cppo") else (":" if rows[name].kind == "fair" else "--")
            ax.plot(x, acc, style, marker="o", ms=3, label=rows[name].label)
    target = stats.get("grpo", {}).get("accuracy", (None, None))[0]
    for ax, title in zip(axes, ("training seconds (no eval, no checkpoints)", "wall seconds (with eval)")):
        if target is not None:
            ax.axhline(100 * target, color="gray", lw=0.8, ls="--")
        ax.set_xlabel(title)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out greedy accuracy % (mean over seeds)")
    axes[1].legend(fontsize=7, loc="lower right")
    fig.suptitle("Held-out accuracy against time, per method (dashed: GRPO's final accuracy)")
    return fig


def plot_speedup(plt, raw: dict, stats: dict):
    """Speed-up against P: measured, ideal, bounds and the paper's numbers."""
    runs = raw["runs"]
    fig, ax = plt.subplots(figsize=(7, 5))
    grid = [i / 100 for i in range(0, 95)] + [0.9375]
    ax.plot(grid, [1 / (1 - p) for p in grid], "k:", label="ideal 1/(1-P)")
    ax.plot(list(PAPER_SPEEDUP), list(PAPER_SPEEDUP.values()), "s--", color="gray", label="paper (GSM8K)")
    measured = [(p, stats[f"cppo-{p:g}"]) for p in PRUNING_RATES if "speedup_train" in stats.get(f"cppo-{p:g}", {})]
    if measured:
        ps = [p for p, _ in measured]
        ax.errorbar(ps, [s["speedup_train"] for _, s in measured],
                    yerr=[mean_std(s["speedup_train_per_seed"])[1] for _, s in measured],
                    fmt="o-", color="C0", capsize=3, label="measured vs GRPO (B = 16)")
        ax.plot(ps, [s["bound"] for _, s in measured], "^--", color="C1", label="measured bound")
        ax.plot(ps, [s["classic_amdahl"] for _, s in measured], "v:", color="C2", label="classic Amdahl")
    fair = [(p, fair_stats(runs, p)) for p in PRUNING_RATES]
    fair = [(p, f) for p, f in fair if f]
    if fair:
        ax.plot([p for p, _ in fair], [f["speedup_train"] for _, f in fair], "D-", color="C3",
                label="measured vs fair GRPO (same Q)")
    ax.set_yscale("log", base=2)
    ax.set_xlabel("pruning rate P")
    ax.set_ylabel("speed-up in training seconds")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax.set_title("CPPO speed-up against P")
    return fig
