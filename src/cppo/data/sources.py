"""Resolve `dataset_name` to training rows, held-out rows and the accuracy reward used for eval.

Rows are plain dicts with a 'prompt' (text or chat messages) and pass-through columns such as
'answer' that reach reward functions as keyword lists (TRL's convention).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from cppo.data import arithmetic

logger = logging.getLogger(__name__)


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


ACCURACY_REWARDS = {"gsm8k": "gsm8k", "math": "math"}  # data format -> registry name


def load_task(cfg, tokenizer=None) -> TaskData:
    """TaskData for a CPPOConfig (or any object with the same field names).

    GSM8K/MATH rows get prompts in ``cfg.prompt_style``; as chat messages when the tokenizer has a
    chat template (or no tokenizer is given), else as plain text. Bad rows are skipped and counted
    (``skipped_rows``: train ones as (index, reason), held-out ones as ("<split>:<index>", reason)).
    Held-out rows come from ``cfg.eval_dataset_split`` of the same source: the split's file in a
    directory, or for a single file ``<name with the train split word replaced>`` (e.g.
    gsm8k_train.jsonl -> gsm8k_test.jsonl); a source without one has no held-out evaluation.
    The accuracy reward (for eval) follows the data format: gsm8k -> 'gsm8k', math -> 'math',
    ready-made prompts -> the first of reward_funcs.
    """
    if cfg.dataset_name == "embedded":
        return embedded_task(cfg.task_level, seed=cfg.seed, num_train=cfg.num_train_questions,
                             num_eval=cfg.eval_num_questions)
    from cppo.data.loaders import load_prompt_dataset

    conversational = tokenizer is None or getattr(tokenizer, "chat_template", None) is not None

    def load(source: str, split: str, limit):
        return load_prompt_dataset(source, split=split, prompt_style=cfg.prompt_style, limit=limit,
                                   conversational=conversational)

    train = load(cfg.dataset_name, cfg.dataset_split, cfg.num_train_questions)
    skipped = list(train.skipped_rows)
    evaluation, eval_skipped = [], []
    eval_source = _eval_source(cfg.dataset_name, cfg.dataset_split, cfg.eval_dataset_split)
    if eval_source is not None:
        try:
            held_out = load(eval_source, cfg.eval_dataset_split, cfg.eval_num_questions)
        except (ValueError, FileNotFoundError, KeyError) as err:
            logger.warning("%s: no held-out split %r (%s); training without evaluation",
                           cfg.dataset_name, cfg.eval_dataset_split, err)
        else:
            if held_out.source == train.source:
                logger.warning("%s: the held-out split %r resolves to the training data (%s); "
                               "training without evaluation", cfg.dataset_name,
                               cfg.eval_dataset_split, train.source)
            else:
                evaluation = [dict(r) for r in held_out.dataset]
                eval_skipped = [(f"{cfg.eval_dataset_split}:{i}", why) for i, why in held_out.skipped_rows]
    rows = [dict(r) for r in train.dataset]
    check_rows(rows, name=f"{cfg.dataset_name} ({cfg.dataset_split})")
    accuracy = ACCURACY_REWARDS.get(train.format, cfg.reward_funcs[0])
    return TaskData(train_rows=rows, eval_rows=evaluation, accuracy_reward=accuracy,
                    skipped_rows=skipped + eval_skipped,
                    description=f"{cfg.dataset_name} ({train.format} format)")


def _eval_source(name: str, train_split: str, eval_split: str) -> str | None:
    """Where the held-out split lives: the same hub id / directory, or a sibling file named after
    the split; None for a single file with no such sibling."""
    path = Path(name).expanduser()
    if not path.is_file():
        return name
    if train_split and train_split in path.name:
        sibling = path.with_name(path.name.replace(train_split, eval_split))
        if sibling.is_file():
            return str(sibling)
    logger.warning("%s: a single file has no %r split (no %s next to it); training without "
                   "held-out evaluation", name, eval_split,
                   path.name.replace(train_split, eval_split) if train_split in path.name
                   else f"file named with {eval_split!r}")
    return None
