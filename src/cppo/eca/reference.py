"""Plain blocked triangular products: the classical reference the schemes are measured against.

Split in 2x2 blocks; the off-diagonal block is one GEMM written straight into the output, the two
diagonal blocks recurse; below `block` rows a dense product is masked. This does the needed half of
a full product (plus block/n of waste on the diagonal).
"""

from __future__ import annotations

import torch

DEFAULT_BLOCK = 256


def blocked_masked_matmul(a: torch.Tensor, b: torch.Tensor, block: int = DEFAULT_BLOCK) -> torch.Tensor:
    """tril(a @ b^T) by 2x2 triangular recursion: a, b (..., n, m) -> (..., n, n)."""
    n, batch = a.shape[-2], torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    out = a.new_empty(*batch, n, n)
    _masked_into(_flat(a, batch), _flat(b, batch), out.view(-1, n, n), block)
    return out


def _flat(x: torch.Tensor, batch) -> torch.Tensor:
    return x.expand(*batch, *x.shape[-2:]).reshape(-1, *x.shape[-2:])


def _masked_into(a, b, out, block):
    n = a.shape[-2]
    if n <= block:
        torch.matmul(a, b.mT, out=out)
        out.tril_()
        return
    h = n // 2
    out[:, :h, h:].zero_()
    torch.matmul(a[:, h:, :], b[:, :h, :].mT, out=out[:, h:, :h])
    _masked_into(a[:, :h, :], b[:, :h, :], out[:, :h, :h], block)
    _masked_into(a[:, h:, :], b[:, h:, :], out[:, h:, h:], block)


def blocked_lower_matmul(lower: torch.Tensor, x: torch.Tensor, block: int = DEFAULT_BLOCK) -> torch.Tensor:
    """tril(lower) @ x by 2x2 triangular recursion: (..., n, n), (..., n, d) -> (..., n, d)."""
    batch = torch.broadcast_shapes(lower.shape[:-2], x.shape[:-2])
    out = x.new_empty(*batch, *x.shape[-2:])
    _lower_into(_flat(lower, batch), _flat(x, batch), out.view(-1, *x.shape[-2:]), block)
    return out


def _lower_into(t, x, out, block):
    n = t.shape[-1]
    if n <= block:
        torch.matmul(t.tril(), x, out=out)
        return
    h = n // 2
    _lower_into(t[:, :h, :h], x[:, :h, :], out[:, :h, :], block)
    _lower_into(t[:, h:, h:], x[:, h:, :], out[:, h:, :], block)
    out[:, h:, :].baddbmm_(t[:, h:, :h], x[:, :h, :])
