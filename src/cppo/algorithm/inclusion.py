"""The `unbiased` selection rule's math: inclusion probabilities from |advantage|, a fixed-size
systematic draw, and the weights that make the kept completions' policy gradient an unbiased
estimate of the whole batch's.

A design chooses `keep` of N units (a question's G completions in the 'question' scope, the
step's Q * G in the 'step' scope). Unit i is kept with probability

    pi_i = min(1, c * s_i),   s_i = |A_i| + FLOOR * mean(|A|)   (mean over the design's units)

with c set so that sum(pi) = keep (iterative capping: units with c * s_i >= 1 get pi = 1, c is
recomputed on the rest). The floor (0.1 of the mean |A|) keeps every pi_i > 0, so a zero
advantage can still be drawn (its KL and entropy terms count) and no weight exceeds
(1 + FLOOR) / FLOOR = 11 times the uniform one; a design whose |A| are all 0 is uniform.
The draw is systematic sampling on a random order: exactly `keep` units, unit i with
probability pi_i (exact up to float64 rounding). The loss then takes A_i * w_i on the kept
ones, w_i = share / pi_i, share = D_kept / D_all the loss normaliser's share of the batch kept
(keep / N for per-sequence means), so E[sum_kept w_i g_i] / D_kept = sum_all g_i / D_all: the
Horvitz-Thompson estimator of the unpruned policy term.
"""

from __future__ import annotations

import torch
from torch import Tensor

FLOOR = 0.1          # s_i = |A_i| + FLOOR * mean|A|: every pi_i > 0, every weight <= 11x uniform
CAP_TOLERANCE = 1e-9  # c * s_i >= 1 - CAP_TOLERANCE counts as capped: every drawn pi < 1 - 1e-9


def design_rows(values: Tensor, scope: str) -> Tensor:
    """(R, N) the designs' units as rows: (Q, G) in the 'question' scope, (1, Q * G) in 'step'."""
    return values if scope == "question" else values.reshape(1, -1)


def capped_probabilities(scores: Tensor, keep: int) -> Tensor:
    """(R, N) inclusion probabilities pi = min(1, c_r * scores), each row summing to `keep`
    (scores (R, N) > 0, keep <= N): the units whose pi would exceed 1 are set to 1 and the
    rest renormalised, until none does (at most N rounds)."""
    capped = torch.zeros_like(scores, dtype=torch.bool)
    scale = torch.zeros_like(scores[:, :1])
    for _ in range(scores.shape[1] + 1):
        free = scores * ~capped
        left = keep - capped.sum(1, keepdim=True)
        scale = left / free.sum(1, keepdim=True).clamp(min=torch.finfo(scores.dtype).tiny)
        over = ~capped & (free * scale >= 1.0 - CAP_TOLERANCE)
        if not bool(over.any()):
            break
        capped |= over
    return torch.where(capped, torch.ones_like(scores), scores * scale)


def inclusion_probabilities(advantages: Tensor, *, num_keep: int, scope: str,
                            floor: float = FLOOR) -> Tensor:
    """(Q, G) float64 pi of the `unbiased` rule: pi_i proportional to |A_i| + floor * mean|A|
    within each design (a question, or the step), capped at 1, summing to num_keep // Q per
    question ('question') or num_keep over the step ('step')."""
    if floor <= 0:
        raise ValueError(f"floor must be > 0 (every completion needs pi > 0), got {floor}")
    num_questions, group_size = advantages.shape
    if advantages.numel() == 0:
        return torch.zeros(advantages.shape, dtype=torch.float64, device=advantages.device)
    size = design_rows(advantages.detach().to(torch.float64).abs(), scope)
    keep = num_keep // num_questions if scope == "question" else num_keep
    mean = size.mean(1, keepdim=True)
    scores = torch.where(mean > 0, size + floor * mean, torch.ones_like(size))   # all 0: uniform
    return capped_probabilities(scores, keep).reshape(num_questions, group_size)


def systematic_sample(probabilities: Tensor, generator: torch.Generator | None) -> Tensor:
    """(R, N) bool: in each row exactly round(sum(pi)) units, unit i with probability pi_i
    (probabilities (R, N) in [0, 1]). Units with pi = 1 are always kept; the rest are laid end to
    end in a random order (drawn from `generator`, units with pi = 0 first) and kept where one of
    the points U + 0, U + 1, ... (U ~ Uniform[0, 1)) falls in their interval. Drawn on the
    generator's device."""
    device = generator.device if generator is not None else probabilities.device
    p = probabilities.to(device, torch.float64)
    rows, units = p.shape
    sure = p >= 1.0
    rest = torch.where(sure, torch.zeros_like(p), p)
    counts = rest.sum(1).round().long()   # (R,) units to draw besides the sure ones
    order = torch.argsort(torch.rand(p.shape, generator=generator, device=device, dtype=torch.float64)
                          + (rest > 0), dim=1, stable=True)   # a random order, pi = 0 first
    ends = rest.gather(1, order).cumsum(1)   # (R, N) the intervals' right ends
    most = int(counts.max()) if rows else 0
    start = torch.rand((rows, 1), generator=generator, device=device, dtype=torch.float64)
    points = start + torch.arange(most, device=device, dtype=torch.float64)   # (R, most)
    slot = torch.searchsorted(ends, points, right=True).clamp(max=units - 1)  # last: pi > 0
    hits = torch.zeros_like(p).scatter_add_(
        1, slot, (torch.arange(most, device=device) < counts[:, None]).to(p.dtype))
    if bool((hits > 1).any()):
        raise RuntimeError("systematic_sample: a unit was drawn twice (probabilities above 1?)")
    drawn = torch.zeros_like(sure).scatter_(1, order, hits > 0)
    return drawn | sure


def keep_by_inclusion(advantages: Tensor, rewards: Tensor, *, num_keep: int, scope: str,
                      generator: torch.Generator | None) -> Tensor:
    """The `unbiased` rule: keep_mask (Q, G), num_keep completions drawn with the probabilities
    of `inclusion_probabilities` (num_keep // Q per question in the 'question' scope)."""
    pi = inclusion_probabilities(advantages, num_keep=num_keep, scope=scope)
    drawn = systematic_sample(design_rows(pi, scope), generator)
    return drawn.reshape(advantages.shape).to(advantages.device)


def inclusion_weights(advantages: Tensor, *, num_keep: int, scope: str, floor: float = FLOOR,
                      kept_share: float | None = None) -> Tensor:
    """(Q, G) float64 w = kept_share / pi: the factor on each kept completion's advantage that
    makes the loss's policy term unbiased for the unpruned one. kept_share: the loss
    normaliser's kept / all (None: num_keep / (Q * G), the kept share of sequences, for losses
    that divide by a number of sequences; for token-normalised ones, kept / all loss tokens)."""
    pi = inclusion_probabilities(advantages, num_keep=num_keep, scope=scope, floor=floor)
    share = num_keep / max(advantages.numel(), 1) if kept_share is None else kept_share
    return torch.where(pi > 0, share / pi.clamp(min=torch.finfo(pi.dtype).tiny), torch.zeros_like(pi))
