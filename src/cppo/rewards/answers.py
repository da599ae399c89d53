"""Answer extraction and number normalisation for reward functions.

Every function here is pure, linear-time in its input and never raises on text: "no answer" is
``None``. Numbers are compared exactly as :class:`fractions.Fraction`.

Number rules (:func:`normalize_number`):

* thousands commas are dropped only when well grouped: ``"1,234"`` -> 1234 (``"3,4,5"`` is not a
  number; its last number is ``5``); GSM8K golds are read with *all* commas removed;
* a leading ``$`` / ``\\$``, a trailing ``.`` and surrounding spaces are ignored: ``"$5."`` -> 5;
* decimals are exact: ``"5.00"`` == ``"5"``; ``"-3"`` and the unicode minus ``"−3"`` are -3;
* fractions ``"1/2"`` and ``\\frac{1}{2}`` (also ``\\dfrac``, ``\\tfrac``) are 1/2;
* a trailing ``%`` (or ``\\%``) is dropped, so ``"50%"`` == 50: GSM8K golds write percentages as
  the bare number, and a model saying "50%" for gold "50" is right;
* scientific notation, words, units and anything longer than ``MAX_NUMBER_CHARS`` are not numbers.
"""

from __future__ import annotations

import re
from fractions import Fraction

MAX_NUMBER_CHARS = 100  # longer "numbers" are rejected (Python refuses int() of >4300 digits)

_INT = r"(?:\d{1,3}(?:,\d{3})+|\d+)"
# one number inside free text: not glued to a preceding letter/digit/dot; sign only when it is
# not a binary minus ("3-4" gives 3 and 4, "is -4" gives -4)
_NUMBER_IN_TEXT = re.compile(rf"(?<![\w.])(?:(?<![\w)\]}}])[-−])?\$?{_INT}(?:\.\d+)?(?:/\d+)?")
_PLAIN_NUMBER = re.compile(rf"[-+]?{_INT}(?:\.\d+)?")
_FRACTION = re.compile(rf"([-+]?{_INT})\s*/\s*({_INT})")
_LATEX_FRAC = re.compile(r"^([-+]?)\\[dt]?frac\{\s*([-+]?[\d,.]+)\s*\}\{\s*([-+]?[\d,.]+)\s*\}$")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOXED_TOKEN = re.compile(r"\\boxed\s*\{|\{|\}")


def completion_text(completion) -> str:
    """Text of a TRL completion: a string, or chat messages (the last message's content)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return _content_text(completion.get("content"))
    if isinstance(completion, (list, tuple)) and completion:
        last = completion[-1]
        return _content_text(last.get("content")) if isinstance(last, dict) else ""
    return ""


def _content_text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # multimodal parts: [{"type": "text", "text": ...}, ...]
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def extract_gsm8k_gold(text: str) -> str | None:
    """GSM8K gold: the text after the last ``####``, stripped, commas removed; None if absent/empty."""
    if not isinstance(text, str) or "####" not in text:
        return None
    gold = text.rsplit("####", 1)[1].strip().replace(",", "")
    return gold or None


def extract_answer_tag(text: str) -> str | None:
    """Stripped content of the last complete ``<answer>...</answer>`` block, or None."""
    if not isinstance(text, str) or "</answer>" not in text:
        return None
    start = text.rfind("<answer>")
    end = text.find("</answer>", start + 8) if start >= 0 else -1
    if start < 0 or end < 0:  # last <answer> never closed: fall back to the last complete block
        matches = _ANSWER_TAG.findall(text[: text.rfind("</answer>") + 9])
        return matches[-1].strip() if matches else None
    return text[start + 8 : end].strip()


def extract_last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` whose braces balance (nesting allowed), or None.

    "Last" means the latest opening ``\\boxed`` (as in the MATH reference code), so
    ``\\boxed{\\boxed{1}}`` gives ``1``. One pass with an explicit stack: deep nesting is fine.
    """
    if not isinstance(text, str) or "\\boxed" not in text:
        return None
    stack: list[int] = []  # content start for \boxed{, -1 for a plain {
    best_start, best_span = -1, None
    for match in _BOXED_TOKEN.finditer(text):
        token = match.group()
        if token == "}":
            if stack:
                start = stack.pop()
                if start > best_start:
                    best_start, best_span = start, (start, match.start())
        elif token == "{":
            stack.append(-1)
        else:
            stack.append(match.end())
    return text[best_span[0] : best_span[1]].strip() if best_span else None


def extract_last_number(text: str) -> str | None:
    """The last number written in ``text`` (as written: ``"1,234"``, ``"-3.5"``, ``"1/2"``), or None."""
    if not isinstance(text, str):
        return None
    last = None
    for last in _NUMBER_IN_TEXT.finditer(text):
        pass
    return last.group() if last else None


def normalize_number(text: str) -> Fraction | None:
    """The exact value of a number written alone (rules in the module docstring), or None."""
    if not isinstance(text, str):
        return None
    s = text.strip().replace("−", "-").replace("\\!", "").replace("\\,", "").replace("{,}", ",")
    s = s.replace(" ", "")
    if not s or len(s) > MAX_NUMBER_CHARS:
        return None
    if s.startswith("$") and s.endswith("$") and len(s) > 1:  # inline math: $5$
        s = s[1:-1]
    s = s.rstrip(".")
    for suffix in ("\\%", "%"):
        if s.endswith(suffix):
            s = s[: -len(suffix)]
    sign = ""
    if s and s[0] in "+-":
        sign, s = s[0], s[1:]
    for prefix in ("\\$", "$"):
        if s.startswith(prefix):
            s = s[len(prefix) :]
    s = sign + s
    try:
        if _PLAIN_NUMBER.fullmatch(s):
            return Fraction(s.replace(",", ""))
        if m := _FRACTION.fullmatch(s):
            return Fraction(int(m[1].replace(",", "")), int(m[2].replace(",", "")))
        if m := _LATEX_FRAC.fullmatch(s):
            value = Fraction(m[2].replace(",", "")) / Fraction(m[3].replace(",", ""))
            return -value if m[1] == "-" else value
    except (ValueError, ZeroDivisionError):
        return None
    return None


def find_number(text: str) -> Fraction | None:
    """``text`` read as one number, else its last number; None when it holds none."""
    value = normalize_number(text)
    if value is None:
        value = normalize_number(extract_last_number(text) or "")
    return value


def extract_numeric_answer(completion: str) -> Fraction | None:
    """The number a completion gives as its answer, or None.

    Looks in order at the ``<answer>`` block, the last ``\\boxed{}`` and the whole text; the first
    place that exists decides (a boxed answer inside ``<answer>`` is preferred there too).
    """
    if not isinstance(completion, str):
        return None
    tagged = extract_answer_tag(completion)
    if tagged is not None:
        boxed = extract_last_boxed(tagged)
        return find_number(boxed if boxed is not None else tagged)
    boxed = extract_last_boxed(completion)
    if boxed is not None:
        return find_number(boxed)
    return normalize_number(extract_last_number(completion) or "")


def gold_number(gold: str) -> Fraction | None:
    """The numeric value of a gold answer: GSM8K style (``... #### 1,234``) or a plain number."""
    if not isinstance(gold, str):
        return None
    if "####" in gold:
        return normalize_number(extract_gsm8k_gold(gold) or "")
    return normalize_number(gold)
