"""Resolve `dataset_name` to training rows, held-out rows and the accuracy reward used for eval.

Rows are plain dicts with a 'prompt' (text or chat messages) and pass-through columns such as
'answer' that reach reward functions as keyword lists (TRL's convention).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cppo.data import arithmetic


@dataclass
class TaskData:
    train_rows: list[dict]
    eval_rows: list[dict]
    accuracy_reward: str              # registry name of the reward that defines "correct"
    max_answer_tokens: int | None = None  # embedded task: digits + EOS
    skipped_rows: list = field(default_factory=list)  # (row index, reason) skipped while loading
    description: str = ""


def embedded_task(level: int, *, seed: int, num_train: int | None = None,
                  num_eval: int | None = None) -> TaskData:
    train = arithmetic.generate(level, "train", n=num_train, seed=seed)
    test = arithmetic.generate(level, "test", seed=0)  # fixed order: same eval set for every seed
    if num_eval is not None:
        test = test[:num_eval]
    return TaskData(train_rows=[p.to_row() for p in train], eval_rows=[p.to_row() for p in test],
                    accuracy_reward="arithmetic",
                    max_answer_tokens=arithmetic.answer_width(level) + 1,
                    description=f"embedded arithmetic level {level}")


def check_rows(rows: list[dict], *, name: str, required: tuple[str, ...] = ("prompt",)) -> None:
    """Every row needs the required columns with a non-empty value; name the first bad row."""
    if not rows:
        raise ValueError(f"{name}: no rows")
    for i, row in enumerate(rows):
        for col in required:
            if col not in row:
                raise ValueError(f"{name}: row {i} has no '{col}' column (columns: "
                                 f"{', '.join(sorted(row))})")
            value = row[col]
            if value is None or (isinstance(value, (str, list)) and len(value) == 0):
                raise ValueError(f"{name}: row {i} has an empty '{col}'")


def load_task(cfg) -> TaskData:
    """TaskData for a CPPOConfig (or any object with the same field names)."""
    if cfg.dataset_name == "embedded":
        return embedded_task(cfg.task_level, seed=cfg.seed, num_train=cfg.num_train_questions,
                             num_eval=cfg.eval_num_questions)
    from cppo.data.loaders import load_prompt_dataset

    def rows_of(split: str):
        loaded = load_prompt_dataset(cfg.dataset_name, split=split, prompt_style=cfg.prompt_style)
        return [dict(r) for r in loaded.dataset], list(loaded.skipped_rows)

    train, skipped = rows_of(cfg.dataset_split)
    try:
        evaluation, _ = rows_of(cfg.eval_dataset_split)
    except (ValueError, FileNotFoundError, KeyError):
        evaluation = []
    if cfg.num_train_questions is not None:
        train = train[:cfg.num_train_questions]
    if cfg.eval_num_questions is not None:
        evaluation = evaluation[:cfg.eval_num_questions]
    check_rows(train, name=f"{cfg.dataset_name} ({cfg.dataset_split})")
    name = cfg.dataset_name.lower()
    accuracy = "math_accuracy" if "math" in name else (
        "gsm8k_accuracy" if "gsm8k" in name else cfg.reward_funcs[0])
    return TaskData(train_rows=train, eval_rows=evaluation, accuracy_reward=accuracy,
                    skipped_rows=skipped, description=cfg.dataset_name)
