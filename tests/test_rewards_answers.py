"""Answer extraction and number normalisation (cppo.rewards.answers)."""

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cppo.rewards.answers import (
    completion_text,
    extract_answer_tag,
    extract_gsm8k_gold,
    extract_last_boxed,
    extract_last_number,
    extract_numeric_answer,
    find_number,
    gold_number,
    normalize_number,
)


@pytest.mark.parametrize("text, gold", [
    ("She pays 3*4=12 dollars.\n#### 12", "12"),
    ("Total is 1,234\n#### 1,234", "1234"),
    ("#### -3", "-3"),
    ("a #### b #### 7 ", "7"),          # text after the last ####
    ("no marker 12", None),
    ("#### ", None),
])
def test_gsm8k_gold(text, gold):
    assert extract_gsm8k_gold(text) == gold


@pytest.mark.parametrize("text, value", [
    ("1,234", 1234), ("1,234,567", 1234567), ("$5", 5), ("\\$5", 5), ("$5$", 5),
    ("5.00", 5), ("5.", 5), ("-3", -3), ("−3", -3), ("+7", 7), ("0.25", Fraction(1, 4)),
    ("1/2", Fraction(1, 2)), ("-1/2", Fraction(-1, 2)), ("\\frac{1}{2}", Fraction(1, 2)),
    ("\\dfrac{3}{4}", Fraction(3, 4)), ("-\\frac{1}{2}", Fraction(-1, 2)),
    ("50%", 50), ("50\\%", 50), ("1{,}000", 1000), (" 42 ", 42),
])
def test_normalize_number(text, value):
    assert normalize_number(text) == value


@pytest.mark.parametrize("text", [
    "", "   ", "abc", "3,4,5", "12,34", "1e5", "1/0", "5 apples", "x=5", "1" * 200, "--3", "$",
])
def test_normalize_number_rejects(text):
    assert normalize_number(text) is None


@pytest.mark.parametrize("text, last", [
    ("so 3-4 = -1", "-1"),
    ("total 1,234 apples.", "1,234"),
    ("values 3,4,5", "5"),
    ("pay $5.50 now", "$5.50"),
    ("x2 and H2O", None),                 # digits glued to letters are not numbers
    ("ratio 1/2", "1/2"),
    ("The answer is -7.", "-7"),
    ("no digits here", None),
    ("", None),
])
def test_last_number(text, last):
    assert extract_last_number(text) == last


@pytest.mark.parametrize("text, boxed", [
    ("so \\boxed{42}.", "42"),
    ("\\boxed{1} then \\boxed{2}", "2"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{x^{2^{3}}+{1}}", "x^{2^{3}}+{1}"),
    ("\\boxed{\\boxed{7}}", "7"),                        # innermost = latest opening, like MATH's code
    ("\\boxed{5} and a truncated \\boxed{6", "5"),       # last *balanced* one
    ("\\boxed {3}", "3"),
    ("} } \\boxed{4} {", "4"),
    ("no box", None),
    ("\\boxed{", None),
    ("\\boxed{}", ""),
])
def test_last_boxed(text, boxed):
    assert extract_last_boxed(text) == boxed


def test_last_boxed_deep_nesting_is_fine():
    depth = 50_000
    assert extract_last_boxed("\\boxed{" + "{" * depth + "9" + "}" * depth + "}") == "{" * depth + "9" + "}" * depth
    assert extract_last_boxed("\\boxed{" * depth) is None


@pytest.mark.parametrize("text, content", [
    ("<think>x</think><answer> 12 </answer>", "12"),
    ("<answer>1</answer> <answer>2</answer>", "2"),
    ("<answer>5</answer> then <answer>6", "5"),
    ("<answer>unclosed", None),
    ("</answer> only", None),
    ("nothing", None),
])
def test_answer_tag(text, content):
    assert extract_answer_tag(text) == content


@pytest.mark.parametrize("completion, value", [
    ("<think>2+2 is 4, not 5</think><answer>4</answer>", 4),
    ("<think>10</think><answer>The total is $1,200.</answer>", 1200),
    ("<answer>\\boxed{3} (not 9)</answer>", 3),       # boxed wins inside <answer>
    ("I think 7, so \\boxed{8}. Check: 9", 8),          # boxed wins over the last number
    ("\\boxed{18 \\text{ dollars}}", 18),
    ("\\boxed{\\$18}", 18),
    ("It is 5 then 6.5", Fraction(13, 2)),
    ("<answer>no number</answer> 5", None),           # an <answer> block decides
    ("nothing numeric", None),
    ("", None),
])
def test_numeric_answer(completion, value):
    assert extract_numeric_answer(completion) == value


def test_gold_number_and_find_number():
    assert gold_number("work\n#### 1,000") == 1000
    assert gold_number("0.5") == Fraction(1, 2)
    assert gold_number("#### twelve") is None
    assert gold_number(None) is None
    assert find_number("about 12 apples") == 12


def test_completion_text():
    assert completion_text("abc") == "abc"
    assert completion_text([{"role": "assistant", "content": "x"}]) == "x"
    assert completion_text([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]) == "a"
    assert completion_text([{"role": "assistant", "content": [{"type": "text", "text": "p"}, {"type": "text", "text": "q"}]}]) == "pq"
    assert completion_text(None) == "" and completion_text([]) == "" and completion_text([1]) == ""


# --- properties: never raise, always a value or None ------------------------------------------------

_special = st.sampled_from(["<think>", "</think>", "<answer>", "</answer>", "\\boxed{", "{", "}", "####",
                            "$", "\\$", ",", ".", "-", "/", "%", "\\frac{", "<|im_end|>", "<|endoftext|>"])
_texty = st.lists(st.one_of(st.text(max_size=20), _special, st.integers().map(str),
                            st.integers(min_value=10**50, max_value=10**400).map(str)), max_size=30).map("".join)


@settings(max_examples=300, deadline=None)
@given(_texty)
def test_extractors_never_raise(text):
    for extract in (extract_gsm8k_gold, extract_answer_tag, extract_last_boxed, extract_last_number):
        out = extract(text)
        assert out is None or isinstance(out, str)
    for value in (normalize_number(text), find_number(text), extract_numeric_answer(text), gold_number(text)):
        assert value is None or isinstance(value, Fraction)


@settings(max_examples=100, deadline=None)
@given(st.integers(min_value=-10**30, max_value=10**30), st.integers(min_value=0, max_value=4))
def test_written_integers_round_trip(n, style):
    written = [str(n), f"{n:,}", f"{n}.00", f"${n}" if n >= 0 else str(n), f"{n}%"][style]
    assert normalize_number(written) == n
    assert extract_numeric_answer(f"So the answer is {written}.") == n
    assert extract_numeric_answer(f"<answer>{written}</answer>") == n
