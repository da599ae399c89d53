"""Markdown and number formatting of the report."""

from __future__ import annotations


def markdown_table(headers: list[str], rows: list[list], align: str | None = None) -> str:
    """A GitHub markdown table; align is one of 'l', 'r', 'c' per column (default: l then r)."""
    align = align or "l" + "r" * (len(headers) - 1)
    if len(align) != len(headers):
        raise ValueError(f"align has {len(align)} entries for {len(headers)} columns")
    marks = {"l": ":---", "r": "---:", "c": ":---:"}
    cells = [[str(c) for c in row] for row in rows]
    for i, row in enumerate(cells):
        if len(row) != len(headers):
            raise ValueError(f"row {i} has {len(row)} cells for {len(headers)} columns: {row}")
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(marks[a] for a in align) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(lines)


def fmt_pm(mean: float | None, std: float | None, scale: float = 1.0, digits: int = 1,
           suffix: str = "") -> str:
    if mean is None:
        return "n/a"
    text = f"{scale * mean:.{digits}f}{suffix}"
    return text + (f" ± {scale * std:.{digits}f}" if std else "")


def fmt_num(value: float | None, digits: int = 1, suffix: str = "") -> str:
    if value is None:
        return "n/a"
    text = f"{value:.{digits}f}"
    return (text[1:] if text.startswith("-") and float(text) == 0 else text) + suffix   # no "-0.0"


def fmt_list(values) -> str:
    return ", ".join(f"{v:.3f}" for v in values) if isinstance(values, list) else "n/a"
