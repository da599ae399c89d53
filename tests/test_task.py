"""The embedded task: determinism, split disjointness, answers, rewards, export, tokenizer."""

import json
import re

import pytest

from cppo.data import arithmetic
from cppo.rewards import arithmetic as arithmetic_rewards
from cppo.models.tokenizer import build_tokenizer


@pytest.mark.parametrize("level", [1, 2, 3])
def test_splits_are_disjoint_and_cover_everything(level):
    train = {p.prompt for p in arithmetic.generate(level, "train")}
    test = {p.prompt for p in arithmetic.generate(level, "test")}
    assert not train & test
    assert len(train) + len(test) == len(arithmetic.all_problems(level))
    assert 0.05 < len(test) / (len(train) + len(test)) < 0.15


def test_generation_is_seeded_and_distinct():
    a = arithmetic.generate(3, "train", n=50, seed=1)
    assert a == arithmetic.generate(3, "train", n=50, seed=1)
    assert a != arithmetic.generate(3, "train", n=50, seed=2)
    assert len({p.prompt for p in a}) == 50
    # a different seed reorders but never moves a problem across splits
    test = {p.prompt for p in arithmetic.generate(3, "test")}
    assert not {p.prompt for p in arithmetic.generate(3, "train", n=2000, seed=99)} & test


@pytest.mark.parametrize("level, prompt, answer", [
    (1, "07+85=", "092"), (2, "47*6=", "282"), (3, "37*42=", "1554"), (4, "12*34+56=", "00464"),
])
def test_answers_are_exact(level, prompt, answer):
    operands = tuple(int(x) for x in re.split(r"[*+]", prompt[:-1]))
    problem = arithmetic._make(level, operands)
    assert problem.prompt == prompt and problem.answer_text == answer
    assert problem.answer == int(answer) and problem.width == arithmetic.answer_width(level)
    if level < 4:                     # 10^6 problems at level 4: too many to list in a test
        assert problem in arithmetic.all_problems(level)



def test_every_level3_answer_matches_python():
    for p in arithmetic.all_problems(3)[::97]:
        a, b = p.prompt[:-1].split("*")
        assert p.answer == int(a) * int(b) and len(p.answer_text) == 4


def test_level4_two_step():
    p = arithmetic._make(4, (12, 34, 56))
    assert p.prompt == "12*34+56=" and p.answer == 12 * 34 + 56 and p.answer_text == "00464"


@pytest.mark.parametrize("text, value", [("1554", 1554), ("0154", 154), (" 42 ", 42), ("15 54", None),
                                         ("", None), ("12a", None), ("-5", None), ("9" * 100, None)])
def test_extract_answer(text, value):
    assert arithmetic_rewards.extract_answer(text) == value


def test_rewards():
    completions = ["1554", "1555", "", [{"role": "assistant", "content": "1554"}]]
    assert arithmetic_rewards.arithmetic_accuracy_reward(None, completions, answer=["1554"] * 4) == [1.0, 0.0, 0.0, 1.0]
    assert arithmetic_rewards.arithmetic_format_reward(None, ["1554", "155", "15a4", "0000"],
                                               answer=["1554"] * 4) == [1.0, 0.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="needs the dataset column 'answer'"):
        arithmetic_rewards.arithmetic_accuracy_reward(None, ["1"])


def test_export_jsonl(tmp_path):
    path = arithmetic.export_jsonl(arithmetic.generate(3, "test", n=5), tmp_path / "t.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 5 and set(rows[0]) == {"prompt", "answer"}


def test_bad_arguments():
    with pytest.raises(ValueError, match="level 9"):
        arithmetic.generate(9)
    with pytest.raises(ValueError, match="'valid'"):
        arithmetic.generate(3, "valid")
    with pytest.raises(ValueError, match="n=100000"):
        arithmetic.generate(3, "test", n=100000)


def test_tokenizer_round_trip(tmp_path):
    tok = build_tokenizer()
    for text in ["37*42=", "12*34+56=", "0000", "07+85="]:
        ids = tok(text)["input_ids"]
        assert ids[0] == tok.bos_token_id and len(ids) == len(text) + 1
        assert tok.decode(ids, skip_special_tokens=True) == text
    tok.save_pretrained(tmp_path)
    from transformers import AutoTokenizer
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again("37*42=")["input_ids"] == tok("37*42=")["input_ids"]
    assert again.eos_token_id == tok.eos_token_id and again.pad_token_id == tok.pad_token_id


def test_digit_partial_credit_reward():
    got = arithmetic_rewards.arithmetic_digit_reward(None, ["1554", "1555", "0000", "155", "15a4", ""],
                                             answer=["1554"] * 6)
    assert got == [1.0, 0.75, 0.0, 0.0, 0.0, 0.0]
    from cppo.rewards import get_reward_function
    assert get_reward_function("arithmetic_digits") is arithmetic_rewards.arithmetic_digit_reward
