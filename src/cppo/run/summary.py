"""The end of a run: summary.json, the plots and the lines `cppo train` prints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from cppo.run.tracking import write_plots


def run_summary(status: str, *, run_state, wall_seconds: float, phase_seconds: dict,
                total_steps: int, plan, resumed_from, output_dir: Path,
                skipped_data_rows: int, asynchronous: dict | None = None) -> dict:
    """The summary of a run that ended with `status`: steps, held-out accuracy before and after
    (None without evaluations), times, the run counters, the step plan, asynchronous rollouts'
    figures (async_rollout, this session) and the history. (pruning_rate auto adds its last rate,
    `pruning_rate_last`: cppo.features.auto_pruning.)"""
    history = run_state.history
    return {"status": status, "steps": run_state.step, "total_steps": total_steps,
            "accuracy_before": history[0]["accuracy"] if history else None,
            "accuracy_after": history[-1]["accuracy"] if history else None,
            "wall_seconds": round(wall_seconds, 1), "train_seconds": round(run_state.train_seconds, 1),
            "phase_seconds_this_session": {k: round(v, 2) for k, v in phase_seconds.items()},
            **run_state.counters,
            "questions_per_step": plan.questions_per_step,
            "completions_kept_per_step": plan.completions_kept,
            "effective_pruning_rate": round(plan.effective_pruning_rate, 4),
            "resumed_from": resumed_from, "output_dir": str(output_dir),
            "skipped_data_rows": skipped_data_rows,
            **({"asynchronous": asynchronous} if asynchronous else {}), "history": history}


def write_summary(summary: dict, output_dir: Path, records: list[dict]) -> None:
    """summary.json and the plots of the metrics records in output_dir; the summary printed."""
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    plots = write_plots(records, output_dir)
    print(format_summary(summary, plots))


def format_summary(summary: dict, plots: Sequence[Path] = ()) -> str:
    pct = lambda v: "n/a" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    lines = [f"\n== cppo train: {summary['status']} after {summary['steps']}/{summary['total_steps']} steps ==",
             f"held-out greedy accuracy: {pct(summary['accuracy_before'])} -> "
             f"{pct(summary['accuracy_after'])}",
             f"wall time {summary['wall_seconds']} s (training phases {summary['train_seconds']} s)",
             "phases (s): " + ", ".join(f"{k} {v}" for k, v in summary["phase_seconds_this_session"].items()),
             f"questions/step {summary['questions_per_step']}, kept completions/step "
             f"{summary['completions_kept_per_step']} (effective pruning rate "
             f"{summary['effective_pruning_rate']}), skipped steps {summary['skipped_steps']}, "
             f"non-finite steps {summary['nonfinite_steps']}"]
    if "pruning_rate_last" in summary:
        lines.append(f"pruning_rate auto: {summary['pruning_rate_last']} in the last round (the "
                     f"rounds' questions planned for the rate above)")
    if summary.get("asynchronous"):
        a = summary["asynchronous"]
        lines.append(f"asynchronous rollouts: staleness mean {a['staleness_mean']} (max "
                     f"{a['staleness_max']}), {a['dropped_stale']} round(s) dropped as stale; "
                     f"busy: generator {pct(a['generator_busy'])}, trainer {pct(a['trainer_busy'])}")
    if "compile_seconds" in summary:
        lines.append(f"torch.compile: {summary['compile_seconds']} s compiling (within the phases)")
    if summary.get("skipped_data_rows"):
        lines.append(f"data rows skipped while loading: {summary['skipped_data_rows']}")
    lines.append(f"run directory: {summary['output_dir']} (metrics.jsonl, summary.json"
                 + "".join(f", {p.name}" for p in plots) + ", checkpoints)")
    if summary["status"] in ("interrupted", "terminated"):
        lines.append(f"stopped at step {summary['steps']} with a checkpoint: continue with "
                     f"--output_dir {summary['output_dir']} --resume")
    return "\n".join(lines)
