"""Rewrite the generated parts of the docs (run from a source checkout):

    python scripts/update_docs.py          # rewrite them
    python scripts/update_docs.py --check  # exit 1 if any is stale (what tests/test_docs.py checks)

The generated parts: docs/configuration.md's config reference (from the config's fields), and
the results tables of README.md and docs/benchmarks.md (from the committed results files, through
benchmarks/headlines.py), each between its two marker lines.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import headlines  # noqa: E402  (benchmarks/headlines.py)
from cppo.config.reference import with_reference  # noqa: E402

BEGIN = "<!-- results table: written by scripts/update_docs.py from benchmarks/results; do not edit -->"
END = "<!-- end of results table -->"


def with_table(text: str, table: str, name: str) -> str:
    """`text` with the lines between the markers replaced by `table`."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise SystemExit(f"{name}: expected one {BEGIN!r} line, then one {END!r} line")
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{table}\n{END}{tail}"


def generated() -> dict[Path, str]:
    """Each generated file -> its fresh text."""
    readme, benchmarks = ROOT / "README.md", ROOT / "docs" / "benchmarks.md"
    configuration = ROOT / "docs" / "configuration.md"
    return {configuration: with_reference(configuration.read_text()),
            readme: with_table(readme.read_text(), headlines.readme_table(), "README.md"),
            benchmarks: with_table(benchmarks.read_text(), headlines.docs_table(),
                                   "docs/benchmarks.md")}


def main(argv: list[str]) -> int:
    stale = []
    for path, fresh in generated().items():
        if path.read_text() == fresh:
            continue
        stale.append(path.relative_to(ROOT))
        if "--check" not in argv:
            path.write_text(fresh)
            print(f"wrote {path.relative_to(ROOT)}")
    if "--check" in argv:
        print("stale: " + ", ".join(map(str, stale)) if stale else "the generated docs are up to date")
        return int(bool(stale))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
