"""The embedded task: seeded arithmetic problems with exact integer answers.

A problem is a prompt such as ``37*42=`` and a gold answer written with a fixed number of digits
(zero-padded), e.g. ``1554``. Four levels:

| level | prompt      | example       | answer digits |
|-------|-------------|---------------|---------------|
| 1     | ``ab+cd=``  | ``07+85=``    | 3             |
| 2     | ``ab*c=``   | ``47*6=``     | 3             |
| 3     | ``ab*cd=``  | ``37*42=``    | 4  (default)  |
| 4     | ``ab*cd+ef=`` | ``12*34+56=`` | 5           |

Train and test splits are disjoint by construction: a problem belongs to the test split iff a
hash of its text falls in the lowest ``TEST_FRACTION`` of the hash range. The hash does not depend
on the seed, so no seed, size or level setting can ever leak a test problem into training.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

TEST_FRACTION = 0.10
LEVELS = (1, 2, 3, 4)
DEFAULT_LEVEL = 3   # 2x2-digit multiplication: the embedded default
# operand digit counts and operators per level; answer width in digits
_LEVEL_SPEC = {
    1: ((2, 2), ("+",), 3),
    2: ((2, 1), ("*",), 3),
    3: ((2, 2), ("*",), 4),
    4: ((2, 2, 2), ("*", "+"), 5),
}


@dataclass(frozen=True)
class Problem:
    prompt: str   # e.g. "37*42="
    answer: int   # e.g. 1554
    width: int    # digits in the written answer

    @property
    def answer_text(self) -> str:
        return f"{self.answer:0{self.width}d}"

    def to_row(self) -> dict:
        return {"prompt": self.prompt, "answer": self.answer_text}


def answer_width(level: int) -> int:
    _check_level(level)
    return _LEVEL_SPEC[level][2]


def _check_level(level: int) -> None:
    if level not in LEVELS:
        raise ValueError(f"task level {level!r} is not one of {LEVELS}")


def _make(level: int, operands: tuple[int, ...]) -> Problem:
    digits, ops, width = _LEVEL_SPEC[level]
    parts = [f"{x:0{n}d}" for x, n in zip(operands, digits)]
    text = parts[0] + "".join(op + p for op, p in zip(ops, parts[1:])) + "="
    value = operands[0]
    for op, x in zip(ops, operands[1:]):
        value = value * x if op == "*" else value + x
    return Problem(text, value, width)


def is_test_problem(prompt: str) -> bool:
    """Split membership from a seed-independent hash of the problem text."""
    h = int.from_bytes(hashlib.blake2b(prompt.encode(), digest_size=8).digest(), "big")
    return h < TEST_FRACTION * 2**64


def all_problems(level: int) -> list[Problem]:
    """Every problem of a level, in a fixed order (10^4 to 10^6 problems)."""
    _check_level(level)
    digits = _LEVEL_SPEC[level][0]
    ranges = [range(10**n) for n in digits]
    return [_make(level, ops) for ops in itertools.product(*ranges)]


def split_problems(level: int, split: str) -> list[Problem]:
    """All problems of a split, in a fixed order (a fresh list each call)."""
    return list(_split_problems(level, split))


@functools.lru_cache(maxsize=8)
def _split_problems(level: int, split: str) -> tuple[Problem, ...]:
    if split not in ("train", "test"):
        raise ValueError(f"split {split!r} is not 'train' or 'test'")
    want_test = split == "test"
    return tuple(p for p in all_problems(level) if is_test_problem(p.prompt) == want_test)


def generate(level: int = DEFAULT_LEVEL, split: str = "train", n: int | None = None, seed: int = 0) -> list[Problem]:
    """n distinct problems of a split in a seeded random order (all of them when n is None)."""
    pool = split_problems(level, split)
    if n is not None and not 1 <= n <= len(pool):
        raise ValueError(f"n={n} problems requested but the {split} split of level {level} "
                         f"has {len(pool)}")
    random.Random(seed).shuffle(pool)
    return pool if n is None else pool[:n]


def export_jsonl(problems: Iterable[Problem], path: str | Path) -> Path:
    """Write rows {"prompt", "answer"} for other tools (TRL, verl, ...)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        for p in problems:
            fh.write(json.dumps(p.to_row()) + "\n")
    return path
