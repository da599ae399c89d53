"""What error messages share: a bad value shown short enough to read."""

from __future__ import annotations


def snippet(value, limit: int = 160) -> str:
    """repr(value), cut to `limit` characters with a trailing '...'."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
