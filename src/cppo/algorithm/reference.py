"""The reference model's periodic sync with the policy (TR-DPO; TRL's sync_ref_model)."""

from __future__ import annotations

from typing import Iterable

import torch
from torch import Tensor


def mix_into_reference(reference: Iterable[Tensor], policy: Iterable[Tensor], alpha: float) -> None:
    """In place, parameter by parameter (same order and shapes): ref = alpha * policy +
    (1 - alpha) * ref (TRL's ref_model_mixup_alpha; 1.0 copies the policy)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    reference, policy = list(reference), list(policy)
    if len(reference) != len(policy):
        raise ValueError(f"reference has {len(reference)} parameters, policy {len(policy)}")
    for ref, new in zip(reference, policy):
        ref.mul_(1.0 - alpha).add_(new.detach(), alpha=alpha)


# a decorator written as a call: mutmut does not mutate a decorated function
mix_into_reference = torch.no_grad()(mix_into_reference)
