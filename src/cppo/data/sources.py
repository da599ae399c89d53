"""Resolve `dataset_name` to training rows, held-out rows and the accuracy reward used for eval.

Rows are plain dicts with a 'prompt' (text or chat messages) and pass-through columns such as
'answer' that reach reward functions as keyword lists (TRL's convention).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields
from pathlib import Path

from cppo.data import arithmetic
from cppo.errors import ConfigError, snippet

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TaskSource:
    """Where a task's rows come from: the config fields `load_task` reads."""

    dataset_name: str
    task_level: int
    seed: int
    prompt_style: str
    eval_dataset_split: str
    eval_num_questions: int | None
    dataset_split: str = "train"
    num_train_questions: int | None = None
    dataset_config: str | None = None
    dataset_streaming: bool = False

    @classmethod
    def of(cls, holder) -> "TaskSource":
        """From any object with these field names (CPPOConfig, `cppo eval`'s EvalConfig): the
        builders' and the CLI's way from a config to the data stage's settings."""
        return cls(**{f.name: getattr(holder, f.name) for f in fields(cls)
                      if hasattr(holder, f.name)})


@dataclass
class TaskData:
    train_rows: list[dict]
    eval_rows: list[dict]
    accuracy_reward: str | None       # the data format's reward that defines "correct"; None: none
    max_answer_tokens: int | None = None  # embedded task: digits + EOS
    skipped_rows: list = field(default_factory=list)  # (row index, reason) skipped while loading
    description: str = ""

    def scoring_reward(self, first_training_reward):
        """The reward that decides "correct" in evaluation: the data format's own (arithmetic,
        gsm8k, math), else the first training reward function."""
        if self.accuracy_reward is None:
            return first_training_reward
        from cppo.rewards import get_reward_function
        return get_reward_function(self.accuracy_reward)


def user_task(train_dataset, eval_dataset=None, *, num_train_questions: int | None = None,
              eval_num_questions: int | None = None) -> TaskData:
    """TaskData for rows passed in (`CPPOTrainer(train_dataset=..., eval_dataset=...)`): checked
    like loaded ones, cut to the first N of each (None: all)."""
    rows = [dict(r) for r in train_dataset]
    check_rows(rows, name="train_dataset")
    rows = rows[:num_train_questions]
    evals = [dict(r) for r in eval_dataset][:eval_num_questions] if eval_dataset is not None else []
    return TaskData(train_rows=rows, eval_rows=evals, accuracy_reward=None, description="user data")


def embedded_task(level: int, *, seed: int, num_train: int | None = None,
                  num_eval: int | None = None, eval_split: str = "test") -> TaskData:
    """The embedded arithmetic task: shuffled train rows and a fixed-order `eval_split` (test, or
    train to measure how much of what was learned is memorised)."""
    if eval_split not in ("train", "test"):
        raise ConfigError(f"'eval_dataset_split' is {eval_split!r}; the embedded task has the "
                          f"splits 'train' and 'test'")
    try:
        train = arithmetic.generate(level, "train", n=num_train, seed=seed)
    except ValueError as err:   # more questions asked for than the level has
        raise ConfigError(f"'num_train_questions' is {num_train}: {err}") from None
    test = arithmetic.generate(level, eval_split, seed=0)  # fixed order: same eval set every seed
    if num_eval is not None:
        test = test[:num_eval]
    return TaskData(train_rows=[p.to_row() for p in train], eval_rows=[p.to_row() for p in test],
                    accuracy_reward="arithmetic",
                    max_answer_tokens=arithmetic.answer_width(level) + 1,
                    description=f"embedded arithmetic level {level}")


def check_rows(rows: list[dict], *, name: str, required: tuple[str, ...] = ("prompt",)) -> None:
    """Before training, every row must hold the required columns with a non-empty value, the same
    columns as row 0 (reward functions get one list per column), and a prompt that is text or
    chat messages, of one kind for all rows; raises ConfigError naming the first bad row."""
    if not rows:
        raise ConfigError(f"{name}: no rows")
    columns = set(rows[0]) if isinstance(rows[0], dict) else set()
    kind = None
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ConfigError(f"{name}: row {i} is a {type(row).__name__}, expected a dict of columns")
        for col in required:
            if col not in row:
                raise ConfigError(f"{name}: row {i} has no '{col}' column (columns: "
                                  f"{', '.join(sorted(row))})")
            value = row[col]
            if value is None or (isinstance(value, (str, list)) and len(value) == 0):
                raise ConfigError(f"{name}: row {i} has an empty '{col}'")
        if set(row) != columns:
            raise ConfigError(f"{name}: row {i} has columns {sorted(row)} but row 0 has "
                              f"{sorted(columns)}; every row needs the same columns")
        if "prompt" in row:
            row_kind = _prompt_kind(row["prompt"])
            if row_kind is None:
                raise ConfigError(f"{name}: row {i}: 'prompt' must be text or a list of "
                                  f"{{'role': ..., 'content': ...}} messages, got "
                                  f"{snippet(row['prompt'])}")
            if kind is not None and row_kind != kind:
                raise ConfigError(f"{name}: row {i} has a {row_kind} prompt but earlier rows have "
                                  f"{kind} prompts; use one kind for the whole dataset")
            kind = row_kind


def _prompt_kind(prompt) -> str | None:
    if isinstance(prompt, str):
        return "text" if prompt.strip() else None
    if isinstance(prompt, list) and prompt and all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), (str, list)) for m in prompt):
        return "chat"
    return None


ACCURACY_REWARDS = {"gsm8k": "gsm8k", "math": "math"}  # data format -> registry name


def _held_out(source: TaskSource, load, train_source) -> tuple[list[dict], list]:
    """The held-out rows beside a training source and their skipped rows ([] and a warning when
    there is no held-out split, or it resolves to the training data)."""
    eval_source = _eval_source(source.dataset_name, source.dataset_split,
                               source.eval_dataset_split)
    if eval_source is None:
        return [], []
    try:
        held_out = load(eval_source, source.eval_dataset_split, source.eval_num_questions)
    except (ValueError, FileNotFoundError, KeyError) as err:
        logger.warning("%s: no held-out split %r (%s); training without evaluation",
                       source.dataset_name, source.eval_dataset_split, err)
        return [], []
    if held_out.source == train_source:
        logger.warning("%s: the held-out split %r resolves to the training data (%s); "
                       "training without evaluation", source.dataset_name,
                       source.eval_dataset_split, train_source)
        return [], []
    return ([dict(r) for r in held_out.dataset],
            [(f"{source.eval_dataset_split}:{i}", why) for i, why in held_out.skipped_rows])


def load_task(source: TaskSource, tokenizer=None, *, train_split: bool = True) -> TaskData:
    """TaskData for a TaskSource (or a config, read by `TaskSource.of`).

    GSM8K/MATH rows get prompts in ``cfg.prompt_style``; as chat messages when the tokenizer has a
    chat template (or no tokenizer is given), else as plain text. Bad rows are skipped and counted
    (``skipped_rows``: train ones as (index, reason), held-out ones as ("<split>:<index>", reason)).
    Held-out rows come from ``cfg.eval_dataset_split`` of the same source: the split's file in a
    directory, or for a single file ``<name with the train split word replaced>`` (e.g.
    gsm8k_train.jsonl -> gsm8k_test.jsonl); a source without one has no held-out evaluation.
    The accuracy reward (for eval) follows the data format: gsm8k -> 'gsm8k', math -> 'math',
    ready-made prompts -> None (the first training reward function). ``train_split=False`` loads the held-out split
    alone (for `cppo eval`, e.g. on math500, which has no train split).
    """
    cfg = source if isinstance(source, TaskSource) else TaskSource.of(source)
    if cfg.dataset_name == "embedded":
        return embedded_task(cfg.task_level, seed=cfg.seed, num_train=cfg.num_train_questions,
                             num_eval=cfg.eval_num_questions, eval_split=cfg.eval_dataset_split)
    from cppo.data.loaders import load_prompt_dataset

    conversational = tokenizer is None or getattr(tokenizer, "chat_template", None) is not None

    def load(source: str, split: str, limit):
        return load_prompt_dataset(source, split=split, prompt_style=cfg.prompt_style, limit=limit,
                                   conversational=conversational, dataset_config=cfg.dataset_config,
                                   streaming=cfg.dataset_streaming)

    if not train_split:
        try:
            held_out = load(cfg.dataset_name, cfg.eval_dataset_split, cfg.eval_num_questions)
        except (ValueError, FileNotFoundError) as err:
            raise dataset_error(cfg.dataset_name, err) from err
        return TaskData(train_rows=[], eval_rows=[dict(r) for r in held_out.dataset],
                        accuracy_reward=ACCURACY_REWARDS.get(held_out.format),
                        skipped_rows=list(held_out.skipped_rows),
                        description=f"{cfg.dataset_name} ({held_out.format} format)")
    try:
        train = load(cfg.dataset_name, cfg.dataset_split, cfg.num_train_questions)
    except (ValueError, FileNotFoundError) as err:   # the loader's message names file, row, column
        raise dataset_error(cfg.dataset_name, err) from err
    skipped = list(train.skipped_rows)
    evaluation, eval_skipped = _held_out(cfg, load, train.source)
    rows = [dict(r) for r in train.dataset]
    check_rows(rows, name=f"{cfg.dataset_name} ({cfg.dataset_split})")
    accuracy = ACCURACY_REWARDS.get(train.format)
    return TaskData(train_rows=rows, eval_rows=evaluation, accuracy_reward=accuracy,
                    skipped_rows=skipped + eval_skipped,
                    description=f"{cfg.dataset_name} ({train.format} format)")


def dataset_error(name: str, err: Exception) -> ConfigError:
    """A loader's error (its message names the file, row or column) as dataset_name's."""
    return ConfigError(f"dataset_name '{name}': {err}")


def check_dataset_source(name: str) -> None:
    """Before any loading: a dataset_name written as a path exists (ConfigError otherwise)."""
    from cppo.data.loaders import check_local_source
    try:
        check_local_source(name)
    except FileNotFoundError as err:
        raise dataset_error(name, err) from None


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


def run_task(source: TaskSource, tokenizer=None, train_dataset=None, eval_dataset=None
             ) -> TaskData:
    """A run's data: the trainer's train_dataset (and eval_dataset), else the source's dataset."""
    if train_dataset is None:
        return load_task(source, tokenizer=tokenizer)
    return user_task(train_dataset, eval_dataset, num_train_questions=source.num_train_questions,
                     eval_num_questions=source.eval_num_questions)
