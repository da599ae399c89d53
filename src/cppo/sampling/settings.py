"""The sampling settings (TRL's names), read once from the config and handed to every sampler:
the built-in sampler, the vLLM backend and the tool loop all draw with this one value."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class SamplingSettings:
    """How each token is drawn: temperature, then top_k, top_p, min_p (None or 0: off) and the
    repetition penalty (1: off), as transformers' and vLLM's samplers apply them."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    repetition_penalty: float = 1.0

    @classmethod
    def of(cls, args) -> "SamplingSettings":
        """The settings of a config (CPPOConfig or anything with its field names)."""
        return cls(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                   min_p=args.min_p, repetition_penalty=args.repetition_penalty)

    def kwargs(self) -> dict:
        """Keyword arguments of cppo.sampling.sampler.sample_completions."""
        return asdict(self)

    def vllm_kwargs(self) -> dict:
        """vLLM SamplingParams' arguments for the same settings (its min_p "off" is 0.0, not None)."""
        return {**asdict(self), "min_p": self.min_p or 0.0}
