"""The completions table (`log_completions`): what the policy wrote, how it scored, and which
completions CPPO pruned before the forward passes.

Every round `capture` holds the step's prompts, completion texts, per-function rewards, advantages
and keep mask (references only); at a logging step `emit` takes a sample of rows (whole questions
first, `num_completions_to_print` rows; None: all), prints it as a table (rich, when installed;
pruned rows dimmed and marked), appends it to <output_dir>/completions.jsonl and sends it to the
trackers as a table named "completions" (TRL's name).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

COLUMNS_BEFORE_REWARDS = ["step", "prompt", "completion"]
COLUMNS_AFTER_REWARDS = ["reward", "advantage", "kept"]


@dataclass
class StepSample:
    rows: list[dict]               # Q dataset rows
    texts: list[str]               # Q*G completion texts, question-major
    per_function: torch.Tensor     # (Q*G, F) rewards, NaN where a function returned None
    rewards: torch.Tensor          # (Q, G) weighted sum
    advantages: torch.Tensor       # (Q, G)
    keep_mask: torch.Tensor        # (Q, G) bool


def prompt_text(prompt) -> str:
    """A row's prompt as one string: chat prompts show their last message."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict):
        return str(prompt[-1].get("content", ""))
    return str(prompt)


def _number(value: float) -> float | None:
    return None if math.isnan(value) else round(float(value), 4)


class CompletionsLog:
    def __init__(self, output_dir: str | Path, reward_names: list[str],
                 num_to_print: int | None = None, console=None) -> None:
        self.path = Path(output_dir) / "completions.jsonl"
        self.reward_names = list(reward_names)
        self.num_to_print = num_to_print
        self.console = console
        self.sample: StepSample | None = None

    @property
    def columns(self) -> list[str]:
        return COLUMNS_BEFORE_REWARDS + self.reward_names + COLUMNS_AFTER_REWARDS

    def capture_scores(self, rows: list[dict], texts: list[str], per_function: torch.Tensor) -> None:
        """After scoring: the step's rows, completion texts and per-function rewards (Q*G, F)."""
        self._scored = (rows, list(texts), per_function)

    def capture_selection(self, rewards: torch.Tensor, advantages: torch.Tensor,
                          keep_mask: torch.Tensor) -> None:
        """After selection: rewards, advantages and keep mask (Q, G) of the same step."""
        rows, texts, per_function = self._scored
        self.sample = StepSample(rows, texts, per_function, rewards, advantages, keep_mask)

    def records(self, step: int) -> list[dict]:
        """One dict per sampled completion (question-major: whole groups first)."""
        s = self.sample
        if s is None:
            return []
        q, g = s.rewards.shape
        n = q * g if self.num_to_print is None else min(self.num_to_print, q * g)
        per_function = s.per_function.float().cpu()
        rewards, adv = s.rewards.float().cpu().flatten(), s.advantages.float().cpu().flatten()
        kept = s.keep_mask.cpu().flatten()
        out = []
        for i in range(n):
            record = {"step": step, "prompt": prompt_text(s.rows[i // g]["prompt"]),
                      "completion": s.texts[i]}
            record.update({name: _number(per_function[i, j])
                           for j, name in enumerate(self.reward_names)})
            record.update({"reward": _number(rewards[i]), "advantage": _number(adv[i]),
                           "kept": bool(kept[i])})
            out.append(record)
        return out

    def emit(self, step: int, metrics_log=None, print_table: bool = True) -> list[dict]:
        """Print, write and send the sample of the last captured step; returns its records."""
        records = self.records(step)
        if not records:
            return records
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in records)
        if metrics_log is not None:
            metrics_log.log_table("completions", self.columns,
                                  [[r[c] for c in self.columns] for r in records], step)
        if print_table:
            self.print(records, step)
        return records

    def truncate_after(self, step: int) -> None:
        """On resume: drop the samples of steps after the checkpoint (they will be redone)."""
        if not self.path.is_file():
            return
        lines = [line for line in self.path.read_text().splitlines()
                 if line.strip() and json.loads(line).get("step", 0) <= step]
        self.path.write_text("".join(line + "\n" for line in lines))

    def print(self, records: list[dict], step: int) -> None:
        try:
            from rich.console import Console
            from rich.table import Table
        except ImportError:
            for r in records:
                mark = "kept  " if r["kept"] else "PRUNED"
                print(f"[step {step}] {mark} adv {r['advantage']} reward {r['reward']} | "
                      f"{r['prompt']!r} -> {r['completion']!r}")
            return
        table = Table(title=f"completions at step {step} (pruned rows dimmed)", show_lines=True)
        for column in self.columns[1:]:
            table.add_column(column, overflow="fold")
        for r in records:
            cells = [r["prompt"], r["completion"], *(_fmt(r[n]) for n in self.reward_names),
                     _fmt(r["reward"]), _fmt(r["advantage"]), "kept" if r["kept"] else "PRUNED"]
            table.add_row(*cells, style=None if r["kept"] else "dim strike")
        (self.console or Console()).print(table)


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.3f}"
