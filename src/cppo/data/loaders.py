"""Load GSM8K, MATH or ready-made prompt datasets as a ``datasets.Dataset`` with a ``prompt`` column.

Sources: a hub alias (``"gsm8k"``, ``"math"``, ``"math500"``), any hub id, a local ``.jsonl`` /
``.json`` / ``.parquet`` file, a directory of such files (the files whose name contains the split,
e.g. ``train.jsonl`` or ``train-00000-of-00001.parquet``), or a ``save_to_disk`` directory.

Formats, detected from the columns (or forced with ``format=``):

* ``prompt``: a ``prompt`` column (text or chat messages) -> used as is, other columns pass through;
* ``gsm8k``: ``question`` + ``answer`` ("... #### 72") -> prompt, question, answer (the gold number
  as text, commas removed);
* ``math``: ``problem`` + ``solution`` (and/or ``answer``) -> prompt, problem, solution, answer
  (the given ``answer``, else the solution's last ``\\boxed{}``).

Bad rows (empty question, unparsable gold, malformed prompt) are skipped and reported in
``LoadedDataset.skipped_rows`` as ``(row index, reason)`` with a logged warning, or raise with
``on_bad_row="raise"``. ``limit`` counts kept rows: the first ``limit`` good rows are returned.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import datasets

from cppo.data.prompts import PROMPT_STYLES, build_prompt
from cppo.rewards.answers import extract_gsm8k_gold, extract_last_boxed, normalize_number
from cppo.errors import snippet

logger = logging.getLogger(__name__)

# alias -> (hub id, config, format)
HUB_SOURCES: dict[str, tuple[str, str | None, str]] = {
    "gsm8k": ("openai/gsm8k", "main", "gsm8k"),
    "openai/gsm8k": ("openai/gsm8k", "main", "gsm8k"),
    "math": ("DigitalLearningGmbH/MATH-lighteval", "default", "math"),
    "math500": ("HuggingFaceH4/MATH-500", None, "math"),  # split "test" only
}
FORMATS = ("prompt", "gsm8k", "math")
FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
_REQUIRED = {"prompt": ("prompt",), "gsm8k": ("question", "answer"), "math": ("problem",)}
_SPLIT_WORDS = ("train", "test", "validation", "valid", "dev", "eval")


@dataclass
class LoadedDataset:
    """A loaded dataset, where it came from, its format, and the rows left out (index, reason)."""

    dataset: datasets.Dataset
    source: str
    format: str
    skipped_rows: list[tuple[int, str]] = field(default_factory=list)


class _BadRow(ValueError):
    pass


def load_prompt_dataset(
    source: str,
    *,
    split: str = "train",
    prompt_style: str = "r1",
    limit: int | None = None,
    conversational: bool = True,
    format: str | None = None,
    on_bad_row: str = "skip",
    dataset_config: str | None = None,
    streaming: bool = False,
) -> LoadedDataset:
    """Load ``source`` (see module docstring) as prompts in ``prompt_style`` ("r1", "boxed", "none").

    ``dataset_config`` names a subset and ``streaming`` streams the rows (TRL's dataset_config and
    dataset_streaming): both go to ``datasets.load_dataset``, for a hub id or a local copy of a
    dataset repository (a folder whose README declares its configs); the stream is read until
    ``limit`` rows are kept (all of it without a limit).

    ``prompt_style``/``conversational`` shape the prompts built for GSM8K and MATH rows; a
    ``prompt`` column is never rewritten. Raises ValueError naming the file, row or column at fault.
    """
    if prompt_style not in PROMPT_STYLES:
        raise ValueError(f"unknown prompt_style {prompt_style!r}; expected one of {list(PROMPT_STYLES)}")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise ValueError(f"limit must be a positive int or None, got {limit!r}")
    if format is not None and format not in FORMATS:
        raise ValueError(f"unknown format {format!r}; expected one of {list(FORMATS)} or None (detect)")
    if on_bad_row not in ("skip", "raise"):
        raise ValueError(f"on_bad_row must be 'skip' or 'raise', got {on_bad_row!r}")

    rows, columns, where, hub_format = _read_source(str(source), split, dataset_config, streaming)
    fmt = format or hub_format or _detect_format(columns, where)
    for column in _REQUIRED[fmt]:
        if column not in columns:
            raise ValueError(f"{where}: {fmt} data needs a column {column!r}; columns found: {columns}")
    if fmt == "math" and "solution" not in columns and "answer" not in columns:
        raise ValueError(f"{where}: math data needs a column 'solution' or 'answer'; columns found: {columns}")

    convert = {"prompt": _prompt_row, "gsm8k": _gsm8k_row, "math": _math_row}[fmt]
    kept, skipped, seen = [], [], 0
    for index, row in enumerate(rows):
        seen += 1
        try:
            kept.append(convert(row, prompt_style, conversational))
        except _BadRow as e:
            if on_bad_row == "raise":
                raise ValueError(f"{where}: row {index}: {e}") from None
            skipped.append((index, str(e)))
        if limit is not None and len(kept) >= limit:
            break
    if seen == 0:
        raise ValueError(f"{where}: no rows (empty)")
    if not kept:
        raise ValueError(f"{where}: all {seen} rows are unusable, e.g. row {skipped[0][0]}: {skipped[0][1]}")
    if skipped:
        logger.warning("%s: skipped %d of %d rows, e.g. row %d: %s",
                       where, len(skipped), seen, skipped[0][0], skipped[0][1])
    return LoadedDataset(_to_dataset(kept, where), where, fmt, skipped)


# --- reading --------------------------------------------------------------------------------------

def check_local_source(source: str) -> None:
    """FileNotFoundError for a source written as a path (a data file's suffix, or ./ / ~) that
    does not exist; a hub id or a registry name passes."""
    if (source.endswith(FILE_SUFFIXES) or source.startswith((".", "/", "~"))) and \
            not Path(source).expanduser().exists():
        raise FileNotFoundError(f"dataset file or directory not found: {source}")


def _read_source(source: str, split: str, dataset_config: str | None = None,
                 streaming: bool = False):
    """-> (rows, column names, description for messages, format implied by a hub alias or None)."""
    path = Path(source).expanduser()
    if path.is_file() and (dataset_config or streaming):
        raise ValueError(f"dataset_config / dataset_streaming name a datasets dataset's subset or "
                         f"stream; {source} is a single file: remove them")
    if path.is_dir() and (dataset_config or streaming):   # a local copy of a dataset repository
        return _load_dataset(source, source, dataset_config, split, streaming, None)
    if path.is_dir():
        if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
            dataset = _from_disk(path, split)
            return dataset, list(dataset.column_names), str(path), None
        files = _split_files(path, split)
        rows = [row for file in files for row in _read_file(file)]
        where = str(files[0]) if len(files) == 1 else f"{path} ({', '.join(f.name for f in files)})"
        return rows, _column_names(rows), where, None
    if path.is_file():
        rows = _read_file(path)
        return rows, _column_names(rows), str(path), None
    check_local_source(source)
    repo, subset, fmt = HUB_SOURCES.get(source, (source, None, None))
    return _load_dataset(source, repo, dataset_config or subset, split, streaming, fmt)


def _load_dataset(source: str, repo: str, dataset_config: str | None, split: str,
                  streaming: bool, fmt):
    """datasets.load_dataset(repo, dataset_config, split, streaming): _read_source's answer."""
    try:
        args = (repo, dataset_config) if dataset_config else (repo,)
        dataset = datasets.load_dataset(*args, split=split, streaming=streaming)
        columns = dataset.column_names or list(next(iter(dataset), {}))   # a stream may not know
    except Exception as e:
        raise ValueError(
            f"loading {repo!r} (config {dataset_config!r}, split {split!r}"
            f"{', streaming' if streaming else ''}) with datasets.load_dataset failed"
            f"{'' if Path(source).expanduser().is_dir() else ' (not a local file or directory)'}: "
            f"{type(e).__name__}: {e}") from e
    where = f"{repo}[{dataset_config + ':' if dataset_config else ''}{split}]"
    return dataset, list(columns), where, fmt


def _from_disk(path: Path, split: str) -> datasets.Dataset:
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ValueError(f"{path}: no split {split!r}; splits found: {list(loaded)}")
        return loaded[split]
    return loaded  # a single saved Dataset: the split does not apply


def _split_files(directory: Path, split: str) -> list[Path]:
    files = sorted(p for p in directory.iterdir() if p.is_file() and p.name.endswith(FILE_SUFFIXES))
    if not files:
        found = sorted(p.name for p in directory.iterdir())[:20]
        raise ValueError(f"{directory}: no {'/'.join(FILE_SUFFIXES)} files; found {found}")
    matching = [p for p in files if split in p.name]
    if matching:
        return matching
    if not any(word in p.name for p in files for word in _SPLIT_WORDS):
        return files  # no file is named after a split: they all are the data
    raise ValueError(f"{directory}: no file for split {split!r}; files found: {[p.name for p in files]}")


def _read_file(path: Path) -> list[dict]:
    if not path.name.endswith(FILE_SUFFIXES):
        raise ValueError(f"{path}: unsupported file type; expected one of {list(FILE_SUFFIXES)}")
    if path.name.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:
            raise ValueError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from e
    else:
        text = path.read_text(encoding="utf-8")
        rows = _parse_json_rows(text, path)
    if not rows:
        raise ValueError(f"{path}: file is empty (no rows)")
    return rows


def _parse_json_rows(text: str, path: Path) -> list[dict]:
    """JSON Lines, or (for .json) one array of objects / ``{"key": [objects]}``."""
    if path.name.endswith(".json") and text.lstrip()[:1] in ("[", "{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            data = None  # maybe JSON Lines in a .json file
        if isinstance(data, dict) and len(data) == 1 and isinstance(next(iter(data.values())), list):
            data = next(iter(data.values()))
        if isinstance(data, list):
            for i, row in enumerate(data):
                if not isinstance(row, dict):
                    raise ValueError(f"{path}: item {i} is a {type(row).__name__}, expected a JSON object")
            return data
    rows = []
    for line_number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{line_number}: invalid JSON ({e.msg}): {line[:200]!r}") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{line_number}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows


def _column_names(rows: Iterable[dict]) -> list[str]:
    names: dict[str, None] = {}
    for row in rows:
        names.update(dict.fromkeys(row))
    return list(names)


def _detect_format(columns: list[str], where: str) -> str:
    if "prompt" in columns:
        return "prompt"
    if "question" in columns:
        return "gsm8k"
    if "problem" in columns:
        return "math"
    raise ValueError(
        f"{where}: cannot tell the data format from columns {columns}; expected 'prompt', "
        "or 'question' + 'answer' (GSM8K), or 'problem' + 'solution' (MATH)"
    )


# --- rows -----------------------------------------------------------------------------------------


def _text_field(row: dict, name: str) -> str:
    value = row.get(name)
    if not isinstance(value, str) or not value.strip():
        raise _BadRow(f"{name!r} must be a non-empty string, got {snippet(value)}")
    return value


def _gsm8k_row(row: dict, style: str, conversational: bool) -> dict:
    question = _text_field(row, "question")
    raw = row.get("answer")
    if isinstance(raw, (int, float)) and not isinstance(raw, bool):
        raw = str(raw)
    gold = extract_gsm8k_gold(raw) if isinstance(raw, str) and "####" in raw else raw
    if isinstance(gold, str):
        gold = gold.strip().replace(",", "")
    if not isinstance(gold, str) or normalize_number(gold) is None:
        raise _BadRow(f"unparsable GSM8K answer (expected '... #### <number>'): {snippet(row.get('answer'))}")
    return _with_prompt(build_prompt(question, style, conversational), row, answer=gold)


def _math_row(row: dict, style: str, conversational: bool) -> dict:
    problem = _text_field(row, "problem")
    answer = row.get("answer")
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(answer, str) or not answer.strip():
        answer = extract_last_boxed(row.get("solution")) if isinstance(row.get("solution"), str) else None
        if not answer:
            raise _BadRow(f"no answer: the solution has no \\boxed{{...}}: {snippet(row.get('solution'))}")
    return _with_prompt(build_prompt(problem, style, conversational), row, answer=answer.strip())


def _with_prompt(prompt, row: dict, **replaced) -> dict:
    """``row`` with a built ``prompt`` first (replacing any there) and ``replaced`` columns."""
    out = {"prompt": prompt}
    out.update((k, v) for k, v in row.items() if k != "prompt")
    out.update(replaced)
    return out


def _prompt_row(row: dict, style: str, conversational: bool) -> dict:
    prompt = row.get("prompt")
    if isinstance(prompt, str) and prompt.strip():
        return row
    if isinstance(prompt, list) and prompt and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), (str, list))
        for m in prompt
    ):
        return row
    raise _BadRow(f"'prompt' must be non-empty text or a list of {{'role', 'content'}} messages, "
                  f"got {snippet(prompt)}")


def _to_dataset(rows: list[dict], where: str) -> datasets.Dataset:
    columns = {name: [row.get(name) for row in rows] for name in _column_names(rows)}
    try:
        return datasets.Dataset.from_dict(columns)
    except Exception as e:  # pyarrow type errors do not say which column
        import pyarrow as pa

        for name, values in columns.items():
            try:
                pa.array(values)
            except Exception:
                kinds = sorted({type(v).__name__ for v in values})
                raise ValueError(f"{where}: column {name!r} mixes value types {kinds}") from e
        raise ValueError(f"{where}: cannot build a dataset ({type(e).__name__}: {e})") from e
