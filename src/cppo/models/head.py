"""Log-probabilities and entropies over the output head, a chunk of tokens at a time.

For M tokens and a V-word vocabulary the logits are an (M, V) tensor: at V = 152k and M = 1,024
that is 0.6 GB in float32, and autograd keeps it (and the softmax) for the backward pass. Here the
head's matmul, the log-softmax, the gathered log-probability and the entropy run on `chunk` tokens
at a time, forward and backward (the backward recomputes each chunk's logits from the hidden
states), so at most a (chunk, V) block of logits exists at once.

For a token with logits z = h W^T / t (+ b / t), p = softmax(z), lse = logsumexp(z):
  log p(y) = z_y - lse                 d/dz = onehot(y) - p
  H = lse - sum_k p_k z_k              d/dz = -p * (z - (lse - H))
"""

from __future__ import annotations

import torch
from torch import Tensor

HEAD_CHUNK = 256   # tokens per block of logits


def _block_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    logits = hidden @ weight.t()
    if bias is not None:
        logits = logits + bias
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return logits / temperature if temperature != 1.0 else logits


class _ChunkedHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk):
        logps, entropies, lses = [], [], []
        for start in range(0, hidden.shape[0], chunk):
            z = _block_logits(hidden[start:start + chunk], weight, bias, temperature)
            lse = torch.logsumexp(z, -1)
            logps.append(z.gather(-1, targets[start:start + chunk, None]).squeeze(-1) - lse)
            entropies.append(lse - torch.sub(z, lse[:, None]).exp_().mul_(z).sum(-1))
            lses.append(lse)
            del z
        empty = hidden.new_zeros(0, dtype=torch.promote_types(hidden.dtype, torch.float32))
        logp = torch.cat(logps) if logps else empty
        entropy = torch.cat(entropies) if entropies else empty
        lse = torch.cat(lses) if lses else empty
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.temperature, ctx.chunk = temperature, chunk
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros_like(hidden) if need_h else None
        acc = torch.promote_types(weight.dtype, torch.float32)
        grad_w = torch.zeros_like(weight, dtype=acc) if need_w else None
        grad_b = torch.zeros_like(bias, dtype=acc) if need_b and bias is not None else None
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            h = hidden[rows]
            z = _block_logits(h, weight, bias, t)
            p = torch.sub(z, lse[rows, None]).exp_()
            # grad_z = -p * (g_logp + g_H (z - (lse - H))) + onehot(y) g_logp, in two (c, V) buffers
            if grad_entropy is not None:
                z.sub_((lse[rows] - entropy[rows])[:, None]).mul_(grad_entropy[rows, None])
                if grad_logp is not None:
                    z.add_(grad_logp[rows, None])
                p.mul_(z)
            elif grad_logp is not None:
                p.mul_(grad_logp[rows, None])
            del z
            grad_z = p.neg_()
            if grad_logp is not None:
                grad_z.scatter_add_(-1, targets[rows, None], grad_logp[rows, None])
            if t != 1.0:
                grad_z.div_(t)
            if need_h:
                grad_h[rows] = (grad_z.to(weight.dtype) @ weight).to(hidden.dtype)
            if need_w:
                grad_w.addmm_(grad_z.t(), h.to(acc))
            if grad_b is not None:
                grad_b += grad_z.sum(0)
        return (grad_h, grad_w.to(weight.dtype) if grad_w is not None else None,
                grad_b.to(bias.dtype) if grad_b is not None else None, None, None, None)


def chunked_logprobs_and_entropy(hidden: Tensor, weight: Tensor, bias: Tensor | None,
                                 targets: Tensor, temperature: float = 1.0,
                                 chunk: int = HEAD_CHUNK) -> tuple[Tensor, Tensor]:
    """log p(target) (M,) and entropy (M,) (float32 at least) of the distributions softmax((hidden (M, d)
    @ weight (V, d)^T + bias (V,)) / temperature), with gradients to hidden, weight and bias;
    at most `chunk` tokens' logits exist at once, forward and backward."""
    return _ChunkedHead.apply(hidden, weight, bias, targets, temperature, chunk)
