"""What the push tests compare: a model's weights as a vLLM sink sends them, and a change to
every weight (tests/test_weight_sinks.py, tests/test_async_server_push.py)."""

from __future__ import annotations

import torch

from cppo.sampling.vllm import vllm_weights


def weights_of(model) -> list[tuple[str, torch.Tensor]]:
    """(vLLM name, a copy of the tensor) of each weight a vLLM sink sends."""
    with vllm_weights(model) as weights:
        return [(name, t.detach().clone()) for name, t in weights]


def change_in_place(model, by: float) -> None:
    """Every parameter moved by `by`, in place."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(by)
