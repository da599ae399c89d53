"""Exact causal attention whose six matrix products all run through a triangular scheme.

forward:  S = tril(Q K^T) * scale   (masked product)      P = softmax(S) (lower-triangular)
          O = P V                   (lower x general)
backward: dV = P^T dO               (upper x general)      dP = tril(dO V^T) (masked product)
          dS = P * (dP - rowsum(P * dP)) * scale
          dQ = dS K                 (lower x general)      dK = dS^T Q       (upper x general)

Half-precision inputs are computed in fp32 and the results cast back. The L x L matrix P is kept for
backward (like eager attention), so memory is O(L^2) per head.
"""

from __future__ import annotations

import math

import torch

from .executor import lower_matmul, masked_matmul, upper_matmul

ATTENTION_CUTOFF = 32  # recurse while min(L, d) > 32: one scheme level at head dim 128, two at 512


class ECAAttentionFunction(torch.autograd.Function):
    """Autograd Function: (q, k, v, scale, scheme, cutoff or (masked, triangular) cut-offs) -> o,
    all tensors (batch, heads, L, d)."""

    @staticmethod
    def forward(ctx, q, k, v, scale, scheme, cutoff):
        dtype = q.dtype
        q32, k32, v32 = (_compute(t) for t in (q, k, v))
        masked_cutoff, triangular_cutoff = cutoff if isinstance(cutoff, tuple) else (cutoff, cutoff)
        masked_run = dict(scheme=scheme, cutoff=masked_cutoff)
        run = dict(scheme=scheme, cutoff=triangular_cutoff)
        scores = masked_matmul(q32 * scale, k32, **masked_run)  # the scale on q: an L x d pass, not L x L
        length = q.shape[-2]
        above = torch.ones(length, length, dtype=torch.bool, device=q.device).triu_(1)
        probs = scores.masked_fill_(above, float("-inf")).softmax(dim=-1)
        out = lower_matmul(probs, v32, clean=True, **run)  # softmax left exact zeros above the diagonal
        ctx.save_for_backward(q32, k32, v32, probs)
        ctx.scale, ctx.run, ctx.masked_run, ctx.dtype = scale, run, masked_run, dtype
        return out.to(dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, probs = ctx.saved_tensors
        grad_out = _compute(grad_out)
        run, scale = ctx.run, ctx.scale
        grad_v = upper_matmul(probs.mT, grad_out, clean=True, **run) if ctx.needs_input_grad[2] else None
        grad_probs = masked_matmul(grad_out, v, **ctx.masked_run)
        # dS / scale = P * (dP - rowsum(P * dP)) in one fused pass; zero above the diagonal
        grad_scores = torch._softmax_backward_data(grad_probs, probs, -1, probs.dtype)
        grad_q = lower_matmul(grad_scores, k * scale, clean=True, **run) if ctx.needs_input_grad[0] else None
        grad_k = upper_matmul(grad_scores.mT, q * scale, clean=True, **run) if ctx.needs_input_grad[1] else None
        cast = lambda g: None if g is None else g.to(ctx.dtype)  # noqa: E731
        return cast(grad_q), cast(grad_k), cast(grad_v), None, None, None


def check_cutoff(cutoff) -> None:
    """Raise ValueError unless `cutoff` is an int >= 1 or a pair (masked, triangular) of them."""
    pair = cutoff if isinstance(cutoff, tuple) else (cutoff,)
    if len(pair) not in (1, 2) or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in pair):
        raise ValueError(f"cutoff must be an int >= 1 or a pair (masked, triangular) of them, got {cutoff!r}")


def _compute(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def eca_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                  scheme: str = "eca", cutoff: int | tuple[int, int] = ATTENTION_CUTOFF) -> torch.Tensor:
    """Causal softmax attention, exact, with every product computed by `scheme`.

    cutoff: recurse while min(L, d) > cutoff; a pair (masked, triangular) sets the masked products
    (S = QK^T, dP) and the triangular ones (PV, dV, dQ, dK) apart.
    q, k, v: (batch, heads, L, d) with equal shapes (repeat k/v heads first for GQA); returns
    (batch, heads, L, d). Same result as scaled_dot_product_attention(q, k, v, is_causal=True).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4D tensor (batch, heads, L, d), got {getattr(t, 'shape', t)!r}")
    if not (q.shape == k.shape == v.shape):
        raise ValueError(
            f"q, k, v must have equal shapes (batch, heads, L, d), got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.is_floating_point():
        raise TypeError(f"q, k, v must be floating point, got {q.dtype}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    check_cutoff(cutoff)
    return ECAAttentionFunction.apply(q, k, v, scale, scheme, cutoff)
