"""Generate docs/configuration.md's reference table from the config dataclass (keeps them in sync).

    python -m cppo.config.reference            # print the table
    python -m cppo.config.reference --write    # rewrite the block between the markers in docs/configuration.md
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from cppo.config import CPPOConfig

START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"


def config_reference() -> str:
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for fld in dataclasses.fields(CPPOConfig):
        default = fld.default if fld.default is not dataclasses.MISSING else fld.default_factory()
        text = fld.metadata.get("help", "")
        if fld.metadata.get("choices"):
            text += " One of: " + ", ".join(f"`{c}`" for c in fld.metadata["choices"]) + "."
        rows.append(f"| `{fld.name}` | `{default}` | {text.replace('|', '/')} |")
    return "\n".join(rows)


REFERENCE_PATH = Path(__file__).resolve().parents[3] / "docs" / "configuration.md"


def reference_block() -> str:
    return f"{START}\n{config_reference()}\n{END}"


def rewrite_reference(path: Path = REFERENCE_PATH) -> None:
    text = path.read_text()
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    path.write_text(head + reference_block() + tail)


if __name__ == "__main__":
    if "--write" in sys.argv:
        rewrite_reference()
    else:
        print(config_reference())
