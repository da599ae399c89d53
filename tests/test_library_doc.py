"""docs/library.md runs as written: its round by hand on the embedded default, and its table
names every config section."""

import contextlib
import io
import re
from pathlib import Path

from cppo.config.fields import SECTIONS

DOC = Path(__file__).resolve().parents[1] / "docs" / "library.md"


def test_the_round_by_hand_runs_and_trains_the_planned_completions(tmp_path, monkeypatch):
    code = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert len(code) == 1
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code[0], str(DOC), "exec"), {})
    lines = out.getvalue().splitlines()
    assert "StepShape(questions_per_step=8, completions_scored=64, completions_kept=16" in \
        out.getvalue()
    assert lines[-1].startswith("16 of 64 completions trained; loss ")
    assert (tmp_path / "runs" / "parts").is_dir()


def test_the_section_table_lists_every_section():
    named = re.findall(r"^\| `(\w+Section)` \|", DOC.read_text(), re.M)
    assert named == [s.__name__ for s in SECTIONS]
