"""The embedded arithmetic task's rewards (TRL's signature): exact answer, format, digits."""

from __future__ import annotations

import re

_INTEGER = re.compile(r"\s*(\d+)\s*")


def extract_answer(completion: str) -> int | None:
    """The integer a completion states, or None: the whole completion must be digits
    (surrounding whitespace allowed), e.g. '1554' -> 1554, '0154' -> 154, '15 54' -> None."""
    if not isinstance(completion, str) or len(completion) > 64:
        return None
    match = _INTEGER.fullmatch(completion)
    return int(match.group(1)) if match else None


def _completion_text(completion) -> str:
    if isinstance(completion, list):  # chat format: [{"role": "assistant", "content": ...}]
        return completion[-1].get("content", "") if completion else ""
    return completion


def arithmetic_accuracy_reward(prompts, completions, completion_ids=None, answer=None, **kwargs):
    """TRL-signature reward: 1.0 when the completion states exactly the gold integer, else 0.0."""
    if answer is None:
        raise ValueError("arithmetic_accuracy_reward needs the dataset column 'answer'")
    out = []
    for completion, gold in zip(completions, answer, strict=True):
        stated = extract_answer(_completion_text(completion))
        out.append(1.0 if stated is not None and stated == int(gold) else 0.0)
    return out


def arithmetic_format_reward(prompts, completions, completion_ids=None, answer=None, **kwargs):
    """TRL-signature reward: 1.0 when the completion is exactly as many digits as the gold."""
    if answer is None:
        raise ValueError("arithmetic_format_reward needs the dataset column 'answer'")
    return [1.0 if re.fullmatch(r"\d{%d}" % len(str(gold)), _completion_text(c).strip()) else 0.0
            for c, gold in zip(completions, answer, strict=True)]


def arithmetic_digit_reward(prompts, completions, completion_ids=None, answer=None, **kwargs):
    """TRL-signature partial credit: the fraction of answer digits in the right place.

    A completion that is not exactly as many digits as the gold answer gets 0.0. A dense
    companion to the exact-match reward: a wrong answer with three right digits still tells the
    policy which digits to keep."""
    if answer is None:
        raise ValueError("arithmetic_digit_reward needs the dataset column 'answer'")
    out = []
    for completion, gold in zip(completions, answer, strict=True):
        text, gold = _completion_text(completion).strip(), str(gold)
        if len(text) != len(gold) or not text.isdigit():
            out.append(0.0)
        else:
            out.append(sum(a == b for a, b in zip(text, gold)) / len(gold))
    return out
