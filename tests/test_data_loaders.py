"""Prompt building (cppo.data.prompts) and dataset loading (cppo.data.loaders), from local files."""

import json

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cppo.data.loaders import LoadedDataset, load_prompt_dataset
from cppo.data.prompts import BOXED_SYSTEM_PROMPT, R1_SYSTEM_PROMPT, build_prompt
from helpers import write_jsonl

GSM8K_ROWS = [
    {"question": "Tom has 3 boxes of 4 apples. How many apples?", "answer": "3*4=<<3*4=12>>12\n#### 12"},
    {"question": "A car costs $1,200 plus $34. Total?", "answer": "1200+34=1234\n#### 1,234"},
    {"question": "It is 5 degrees and drops 8. Temperature?", "answer": "5-8=-3\n#### -3"},
]
MATH_ROWS = [
    {"problem": "What is $\\frac{1}{2}+\\frac{1}{4}$?", "solution": "Sum is $\\boxed{\\frac{3}{4}}$.",
     "level": "Level 1", "type": "Algebra"},
    {"problem": "Simplify $\\sqrt{8}$.", "solution": "$\\sqrt{8}=\\boxed{2\\sqrt{2}}$", "level": "Level 2",
     "type": "Algebra"},
]


# --- prompts ----------------------------------------------------------------------------------------

def test_build_prompt_styles():
    assert build_prompt("Q?", "r1") == [{"role": "system", "content": R1_SYSTEM_PROMPT},
                                        {"role": "user", "content": "Q?"}]
    assert build_prompt("Q?", "boxed")[0]["content"] == BOXED_SYSTEM_PROMPT
    assert "\\boxed{}" in BOXED_SYSTEM_PROMPT and "<think>" in R1_SYSTEM_PROMPT and "<answer>" in R1_SYSTEM_PROMPT
    assert build_prompt("Q?", "none") == [{"role": "user", "content": "Q?"}]
    assert build_prompt("Q?", "none", conversational=False) == "Q?"
    text = build_prompt("Q?", "r1", conversational=False)
    assert text.startswith(R1_SYSTEM_PROMPT) and text.endswith("User: Q?\nAssistant:")


def test_build_prompt_errors():
    with pytest.raises(ValueError, match=r"unknown prompt style 'cot'.*'r1'"):
        build_prompt("Q?", "cot")
    with pytest.raises(ValueError, match="non-empty string"):
        build_prompt("  ", "r1")


# --- GSM8K ------------------------------------------------------------------------------------------

def test_gsm8k_jsonl(tmp_path):
    loaded = load_prompt_dataset(str(write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS)))
    assert isinstance(loaded, LoadedDataset) and isinstance(loaded.dataset, datasets.Dataset)
    assert loaded.format == "gsm8k" and loaded.skipped_rows == []
    ds = loaded.dataset
    assert set(ds.column_names) == {"prompt", "question", "answer"}
    assert ds["answer"] == ["12", "1234", "-3"]
    assert ds[0]["prompt"][1] == {"role": "user", "content": GSM8K_ROWS[0]["question"]}
    assert ds[0]["prompt"][0]["content"] == R1_SYSTEM_PROMPT


def test_gsm8k_parquet_plain_text_boxed_and_limit(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(GSM8K_ROWS), path)
    loaded = load_prompt_dataset(path, prompt_style="boxed", conversational=False, limit=2)
    assert len(loaded.dataset) == 2
    assert loaded.dataset[0]["prompt"].startswith(BOXED_SYSTEM_PROMPT)
    assert loaded.dataset["answer"] == ["12", "1234"]


def test_directory_picks_the_split(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", GSM8K_ROWS)
    write_jsonl(tmp_path / "test.jsonl", GSM8K_ROWS[:1])
    assert len(load_prompt_dataset(tmp_path).dataset) == 3
    assert len(load_prompt_dataset(tmp_path, split="test").dataset) == 1
    with pytest.raises(ValueError, match=r"no file for split 'validation'.*test.jsonl"):
        load_prompt_dataset(tmp_path, split="validation")


def test_bad_gold_rows_are_skipped_and_counted(tmp_path, caplog):
    rows = GSM8K_ROWS + [{"question": "Q", "answer": "no marker"}, {"question": "", "answer": "#### 1"},
                         {"question": "Q", "answer": "#### twelve"}]
    path = write_jsonl(tmp_path / "g.jsonl", rows)
    loaded = load_prompt_dataset(path)
    assert len(loaded.dataset) == 3
    assert [i for i, _ in loaded.skipped_rows] == [3, 4, 5]
    assert "no marker" in loaded.skipped_rows[0][1] and "'question'" in loaded.skipped_rows[1][1]
    assert "skipped 3 of 6 rows" in caplog.text
    with pytest.raises(ValueError, match=r"g.jsonl: row 3: unparsable GSM8K answer.*'no marker'"):
        load_prompt_dataset(path, on_bad_row="raise")


def test_limit_counts_kept_rows(tmp_path):
    rows = [{"question": "Q", "answer": "bad"}] + GSM8K_ROWS
    loaded = load_prompt_dataset(write_jsonl(tmp_path / "g.jsonl", rows), limit=2)
    assert loaded.dataset["answer"] == ["12", "1234"] and len(loaded.skipped_rows) == 1


# --- MATH -------------------------------------------------------------------------------------------

def test_math_jsonl(tmp_path):
    rows = MATH_ROWS + [{"problem": "No box", "solution": "It is 3.", "level": "Level 1", "type": "Algebra"}]
    loaded = load_prompt_dataset(write_jsonl(tmp_path / "math.jsonl", rows), prompt_style="boxed")
    assert loaded.format == "math"
    ds = loaded.dataset
    assert set(ds.column_names) == {"prompt", "problem", "solution", "answer", "level", "type"}
    assert ds["answer"] == ["\\frac{3}{4}", "2\\sqrt{2}"]
    assert ds["level"] == ["Level 1", "Level 2"]
    assert loaded.skipped_rows[0][0] == 2 and "\\boxed" in loaded.skipped_rows[0][1]


def test_math_keeps_a_given_answer_column(tmp_path):
    rows = [{"problem": "P", "solution": "\\boxed{0.5}", "answer": "\\frac{1}{2}"}, {"problem": "Q", "answer": 7}]
    ds = load_prompt_dataset(write_jsonl(tmp_path / "m.json", rows)).dataset
    assert ds["answer"] == ["\\frac{1}{2}", "7"]


def test_json_array_file(tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"data": MATH_ROWS}))
    assert len(load_prompt_dataset(path).dataset) == 2
    path.write_text(json.dumps(MATH_ROWS))
    assert len(load_prompt_dataset(path).dataset) == 2


# --- ready-made prompts -------------------------------------------------------------------------------

def test_prompt_column_used_as_is(tmp_path):
    rows = [{"prompt": "37*42=", "answer": "1554", "id": 1},
            {"prompt": [{"role": "user", "content": "hi"}], "answer": "0", "id": 2}]
    path = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist(rows[:1]), path)
    loaded = load_prompt_dataset(path, prompt_style="r1")
    assert loaded.format == "prompt" and loaded.dataset[0] == rows[0]
    chat_path = write_jsonl(tmp_path / "chat.jsonl", rows[1:])
    assert load_prompt_dataset(chat_path).dataset[0]["prompt"] == rows[1]["prompt"]


def test_save_to_disk_directory(tmp_path):
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": "a", "x": 1}]),
                               "test": datasets.Dataset.from_list([{"prompt": "b", "x": 2}])})
    dd.save_to_disk(str(tmp_path / "dd"))
    assert load_prompt_dataset(str(tmp_path / "dd"), split="test").dataset["prompt"] == ["b"]
    with pytest.raises(ValueError, match=r"no split 'dev'; splits found: \['train', 'test'\]"):
        load_prompt_dataset(str(tmp_path / "dd"), split="dev")
    datasets.Dataset.from_list(GSM8K_ROWS).save_to_disk(str(tmp_path / "single"))
    assert load_prompt_dataset(str(tmp_path / "single")).dataset["answer"] == ["12", "1234", "-3"]


# --- errors -----------------------------------------------------------------------------------------

def test_missing_column_names_file_column_and_columns_found(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": "Q", "solution": "x"}])
    with pytest.raises(ValueError, match=r"q.jsonl: gsm8k data needs a column 'answer'; columns found: \['question', 'solution'\]"):
        load_prompt_dataset(path)
    path = write_jsonl(tmp_path / "odd.jsonl", [{"text": "Q"}])
    with pytest.raises(ValueError, match=r"odd.jsonl: cannot tell the data format from columns \['text'\]"):
        load_prompt_dataset(path)
    with pytest.raises(ValueError, match="needs a column 'problem'"):
        load_prompt_dataset(write_jsonl(tmp_path / "g.jsonl", GSM8K_ROWS), format="math")


def test_empty_and_broken_files(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="empty.jsonl: file is empty"):
        load_prompt_dataset(tmp_path / "empty.jsonl")
    (tmp_path / "broken.jsonl").write_text(json.dumps(GSM8K_ROWS[0]) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"broken.jsonl:2: invalid JSON"):
        load_prompt_dataset(tmp_path / "broken.jsonl")
    (tmp_path / "list.jsonl").write_text("[1, 2]\n")
    with pytest.raises(ValueError, match=r"list.jsonl:1: expected a JSON object, got list"):
        load_prompt_dataset(tmp_path / "list.jsonl")
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match="bad.parquet: not a readable parquet file"):
        load_prompt_dataset(tmp_path / "bad.parquet")
    write_jsonl(tmp_path / "allbad.jsonl", [{"question": "Q", "answer": "none"}])
    with pytest.raises(ValueError, match=r"all 1 rows are unusable, e.g. row 0"):
        load_prompt_dataset(tmp_path / "allbad.jsonl")
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_prompt_dataset(str(tmp_path / "missing.jsonl"))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match=r"no .jsonl/.json/.parquet files; found \['notes.txt'\]"):
        load_prompt_dataset(tmp_path / "other")


def test_mixed_types_name_the_column(tmp_path):
    rows = [dict(GSM8K_ROWS[0], meta=1), dict(GSM8K_ROWS[1], meta="x")]
    with pytest.raises(ValueError, match=r"column 'meta' mixes value types \['int', 'str'\]"):
        load_prompt_dataset(write_jsonl(tmp_path / "g.jsonl", rows))


def test_bad_arguments(tmp_path):
    path = write_jsonl(tmp_path / "g.jsonl", GSM8K_ROWS)
    for kwargs, message in [({"prompt_style": "cot"}, "unknown prompt_style 'cot'"),
                            ({"limit": 0}, "limit must be a positive int"),
                            ({"format": "csv"}, "unknown format 'csv'"),
                            ({"on_bad_row": "ignore"}, "on_bad_row must be")]:
        with pytest.raises(ValueError, match=message):
            load_prompt_dataset(path, **kwargs)


def test_loaded_rows_score_with_the_rewards(tmp_path):
    """Loader output feeds the reward functions directly (TRL passes columns as keyword lists)."""
    from cppo.rewards.math_rewards import gsm8k_accuracy_reward

    ds = load_prompt_dataset(write_jsonl(tmp_path / "g.jsonl", GSM8K_ROWS)).dataset
    completions = ["<think>..</think><answer>12</answer>", "\\boxed{1,234}", "I get 3"]
    assert gsm8k_accuracy_reward(ds["prompt"], completions, answer=ds["answer"]) == [1.0, 1.0, 0.0]
