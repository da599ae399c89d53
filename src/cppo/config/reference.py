"""docs/configuration.md's reference table, made from the config dataclass.

The table is text; writing it into the docs is `scripts/update_docs.py`'s job, and a test checks
the docs hold it.
"""

from __future__ import annotations

import dataclasses

from cppo.config.fields import CPPOConfig

START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"


def config_reference(cls=CPPOConfig) -> str:
    """One markdown row per field: key, default, help (with its choices)."""
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for fld in dataclasses.fields(cls):
        default = fld.default if fld.default is not dataclasses.MISSING else fld.default_factory()
        text = fld.metadata.get("help", "")
        if fld.metadata.get("choices"):
            text += " One of: " + ", ".join(f"`{c}`" for c in fld.metadata["choices"]) + "."
        rows.append(f"| `{fld.name}` | `{default}` | {text.replace('|', '/')} |")
    return "\n".join(rows)


def reference_block() -> str:
    """The table between its two markers."""
    return f"{START}\n{config_reference()}\n{END}"


def with_reference(text: str) -> str:
    """`text` (a markdown page holding both markers) with the block between them replaced."""
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return head + reference_block() + tail
