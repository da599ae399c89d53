"""fp16: transformers' mixed precision, a gradient scaler over float32 weights; the scaler's
state (its loss scale and growth tracker) is this feature's state."""

from __future__ import annotations

import torch

from cppo.errors import ConfigError


class FP16Scaling:
    name = "fp16_scaling"

    def __init__(self, device: torch.device) -> None:
        self.scaler = torch.amp.GradScaler(device.type)

    @classmethod
    def for_weights(cls, device: torch.device, optimizer) -> "FP16Scaling":
        """The scaler for `optimizer`'s weights. Half-precision trainable weights are refused
        (the scaler cannot unscale them)."""
        half = sorted({str(p.dtype) for group in optimizer.param_groups for p in group["params"]
                       if p.dtype != torch.float32})
        if half:
            raise ConfigError(f"'fp16' is true but the trainable weights are {', '.join(half)}; "
                              f"fp16 mixed precision keeps float32 weights: set torch_dtype: "
                              f"float32")
        return cls(device)

    def state_dict(self) -> dict:
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.scaler.load_state_dict(state)
