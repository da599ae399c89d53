"""Exact speculative sampling with a deterministic drafter: the accept / resample rule.

A drafter proposes tokens x_1..x_d after a row's last token; one policy forward scores them, giving
the sampling distribution p_j (N, V) at each proposed position (after temperature, top-k, top-p).
The standard rule (Leviathan et al. 2023; Chen et al. 2023) accepts x_j with probability
min(1, p_j(x_j) / q_j(x_j)); a deterministic drafter's q_j is a point mass on x_j, so x_j is
accepted with probability p_j(x_j). At the first rejection the token is drawn from the residual
max(0, p_j - q_j), i.e. p_j with x_j removed and renormalised; when all d drafts are accepted the
next token is drawn from p_{d+1} itself. Each emitted token then has exactly the distribution
plain sampling from p gives it, whatever the drafter proposed.
"""

from __future__ import annotations

import torch
from torch import Tensor


def accepted_drafts(draft_probs: Tensor, num_drafts: Tensor, uniforms: Tensor) -> Tensor:
    """How many leading drafts each row accepts (N,).

    draft_probs (N, K): p_j(x_j), the probability the sampling distribution at draft position j
    gives the drafted token; num_drafts (N,): drafts proposed per row (positions j >= num_drafts
    are padding); uniforms (N, K): U[0, 1) draws. Draft j is accepted iff u_j < p_j(x_j) and every
    earlier draft was."""
    positions = torch.arange(draft_probs.shape[1], device=draft_probs.device)
    accept = (uniforms < draft_probs) & (positions[None] < num_drafts[:, None])
    return accept.long().cumprod(1).sum(1)


def accepted_drafts_greedy(argmax: Tensor, drafts: Tensor, num_drafts: Tensor) -> Tensor:
    """accepted_drafts for greedy decoding (N,): draft j is accepted iff it is the argmax at its
    position (N, K) and every earlier draft was."""
    positions = torch.arange(drafts.shape[1], device=drafts.device)
    accept = (argmax == drafts) & (positions[None] < num_drafts[:, None])
    return accept.long().cumprod(1).sum(1)


def residual_weights(probs: Tensor, rejected_token: Tensor, rejected: Tensor) -> Tensor:
    """The distribution (N, V) (unnormalised) to draw the token after the accepted drafts from:
    probs (N, V) at that position with rejected_token (N,) removed where rejected (N,) is True
    (the draft there was rejected), probs unchanged where every draft was accepted."""
    drop = torch.zeros_like(probs, dtype=torch.bool)
    drop.scatter_(1, rejected_token[:, None], rejected[:, None])
    return probs.masked_fill(drop, 0.0)
