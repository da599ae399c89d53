"""The sampling settings (TRL's names), read once from the config and handed to every sampler:
the built-in sampler, the vLLM backend and the tool loop all draw with this one value; and what
one call of the built-in sampler draws (SampleRequest); and what a generation backend reads of
the run besides them (BackendSettings)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Sequence

import torch
from torch import Tensor

if TYPE_CHECKING:
    from cppo.config.sections import SamplingSection, VLLMSection


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
    def of(cls, generation: SamplingSection) -> "SamplingSettings":
        """The settings of the config's generation section (or anything with its field names)."""
        return cls(temperature=generation.temperature, top_p=generation.top_p,
                   top_k=generation.top_k, min_p=generation.min_p,
                   repetition_penalty=generation.repetition_penalty)

    def kwargs(self) -> dict:
        """Keyword arguments of cppo.sampling.logits.sampling_logits."""
        return asdict(self)

    def vllm_kwargs(self) -> dict:
        """vLLM SamplingParams' arguments for the same settings (its min_p "off" is 0.0, not None)."""
        return {**asdict(self), "min_p": self.min_p or 0.0}


@dataclass(frozen=True)
class BackendSettings:
    """What a generation backend reads of the run besides its SamplingSettings (built by
    cppo.assembly.run.backend_settings; picklable: the asynchronous generator process builds its
    own backend from it). generation: the config's generation section (G, the lengths,
    generation_dtype, share_prefixes, speculation); vllm: its vLLM section (use_vllm picks the vLLM
    backend); seed: the run's seed; lean_forward: the model section's; questions_per_step: the
    questions one generation round samples on this process (the sequences vLLM's CPU build sizes
    its KV cache for); model_revision, trust_remote_code: how vLLM loads the model itself;
    importance_sampling_correction: whether a vLLM server's log-probs mode matters."""

    generation: SamplingSection
    vllm: VLLMSection
    seed: int
    lean_forward: bool
    questions_per_step: int
    model_revision: str
    trust_remote_code: bool
    importance_sampling_correction: bool


@dataclass(frozen=True)
class SampleRequest:
    """What every chunk of one cppo.sampling.sampler.sample_completions call draws:
    num_generations completions per prompt (question-major rows) of at most max_new_tokens
    tokens, ending at eos_token_id (one id or several), padded with pad_token_id, drawn from
    `generator` after the `sampling` transforms (greedy: the argmax). record: keep each token's
    log-prob under the sampling distribution; share: the completions of a question start as one
    sequence (cppo.sampling.sampler.Decoding.share_prefixes)."""

    num_generations: int
    max_new_tokens: int
    eos_token_id: int | Sequence[int]
    pad_token_id: int
    sampling: SamplingSettings
    greedy: bool = False
    generator: torch.Generator | None = None
    record: bool = False
    share: bool = False

    def eos(self, device) -> Tensor:
        """(E,) the end-of-sequence ids on `device`."""
        return torch.tensor([self.eos_token_id] if isinstance(self.eos_token_id, int)
                            else list(self.eos_token_id), device=device)
