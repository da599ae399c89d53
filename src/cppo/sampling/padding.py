"""Token-id lists -> one padded batch: ids (N, L) and a mask (N, L), left- or right-padded."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor


def pad_token_lists(rows: Sequence[Sequence[int]], pad_value: int, *, side: str,
                    min_width: int = 0) -> tuple[Tensor, Tensor]:
    """ids (N, L) long, filled with pad_value, and mask (N, L) long, 1 on the given tokens.

    side 'left' puts each row at the end (prompts, for generation), 'right' at the start
    (completions, supervised rows). L = max(min_width, longest row).
    """
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    width = max([min_width, *map(len, rows)])
    ids = torch.full((len(rows), width), pad_value, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if len(row) == 0:
            continue
        columns = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        ids[i, columns] = torch.tensor(list(row), dtype=torch.long)
        mask[i, columns] = 1
    return ids, mask
