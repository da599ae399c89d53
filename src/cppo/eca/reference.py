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
    masked_into(_flat(a, batch), _flat(b, batch), out.view(-1, n, n), block)
    return out


def _flat(x: torch.Tensor, batch) -> torch.Tensor:
    return x.expand(*batch, *x.shape[-2:]).reshape(-1, *x.shape[-2:])


def masked_into(a, b, out, block=DEFAULT_BLOCK):
    """out = tril(a b^T) for (B, n, m) operands and a (B, n, n) output (any row stride)."""
    n = a.shape[-2]
    if n <= block:
        torch.matmul(a, b.mT, out=out)
        out.tril_()
        return
    h = n // 2
    out[:, :h, h:].zero_()
    torch.matmul(a[:, h:, :], b[:, :h, :].mT, out=out[:, h:, :h])
    masked_into(a[:, :h, :], b[:, :h, :], out[:, :h, :h], block)
    masked_into(a[:, h:, :], b[:, h:, :], out[:, h:, h:], block)


def blocked_lower_matmul(lower: torch.Tensor, x: torch.Tensor, block: int = DEFAULT_BLOCK) -> torch.Tensor:
    """tril(lower) @ x by 2x2 triangular recursion: (..., n, n), (..., n, d) -> (..., n, d)."""
    batch = torch.broadcast_shapes(lower.shape[:-2], x.shape[:-2])
    out = x.new_empty(*batch, *x.shape[-2:])
    lower_into(_flat(lower, batch), _flat(x, batch), out.view(-1, *x.shape[-2:]), block)
    return out


def lower_into(t, x, out, block=DEFAULT_BLOCK):
    """out = tril(t) x for (B, n, n), (B, n, d) operands and a (B, n, d) output."""
    n = t.shape[-1]
    if n <= block:
        torch.matmul(t.tril(), x, out=out)
        return
    h = n // 2
    lower_into(t[:, :h, :h], x[:, :h, :], out[:, :h, :], block)
    lower_into(t[:, h:, h:], x[:, h:, :], out[:, h:, :], block)
    out[:, h:, :].baddbmm_(t[:, h:, :h], x[:, :h, :])


def blocked_upper_matmul(upper: torch.Tensor, x: torch.Tensor, block: int = DEFAULT_BLOCK) -> torch.Tensor:
    """triu(upper) @ x by 2x2 triangular recursion: (..., n, n), (..., n, d) -> (..., n, d)."""
    batch = torch.broadcast_shapes(upper.shape[:-2], x.shape[:-2])
    out = x.new_empty(*batch, *x.shape[-2:])
    upper_into(_flat(upper, batch), _flat(x, batch), out.view(-1, *x.shape[-2:]), block)
    return out


def upper_into(t, x, out, block=DEFAULT_BLOCK):
    """out = triu(t) x for (B, n, n), (B, n, d) operands and a (B, n, d) output."""
    n = t.shape[-1]
    if n <= block:
        torch.matmul(t.triu(), x, out=out)
        return
    h = n // 2
    upper_into(t[:, :h, :h], x[:, :h, :], out[:, :h, :], block)
    upper_into(t[:, h:, h:], x[:, h:, :], out[:, h:, :], block)
    out[:, :h, :].baddbmm_(t[:, :h, h:], x[:, h:, :])
