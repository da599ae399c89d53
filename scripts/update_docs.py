"""Rewrite the generated parts of the docs from the code (run from a source checkout):

    python scripts/update_docs.py          # docs/configuration.md's config reference
    python scripts/update_docs.py --check  # exit 1 if the docs are stale (what tests/test_docs.py checks)
"""

from __future__ import annotations

import sys
from pathlib import Path

from cppo.config.reference import with_reference

CONFIGURATION = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def main(argv: list[str]) -> int:
    text = CONFIGURATION.read_text()
    fresh = with_reference(text)
    if "--check" in argv:
        print("docs/configuration.md is " + ("up to date" if fresh == text else "stale"))
        return int(fresh != text)
    CONFIGURATION.write_text(fresh)
    print(f"wrote {CONFIGURATION}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
