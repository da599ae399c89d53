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
    if not rows:
        return torch.full((0, width), pad_value, dtype=torch.long), torch.zeros((0, width), dtype=torch.long)
    lengths = torch.tensor([len(row) for row in rows])
    if side == "left":
        ids = torch.tensor([[pad_value] * (width - len(row)) + list(row) for row in rows], dtype=torch.long)
        mask = torch.arange(width) >= width - lengths[:, None]
    else:
        ids = torch.tensor([list(row) + [pad_value] * (width - len(row)) for row in rows], dtype=torch.long)
        mask = torch.arange(width) < lengths[:, None]
    return ids, mask.long()
