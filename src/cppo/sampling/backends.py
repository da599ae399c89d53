"""Generation backends: where the G completions of each question come from.

One small interface, `backend.generate(prompts, round_index, question_offset) -> Completions`:

* `TransformersBackend` (default): the KV-shared sampler of cppo.sampling.sampler on the policy itself.
* `VLLMEngineBackend` / `VLLMServerBackend` (cppo.sampling.vllm; `use_vllm: true`): vLLM in the
  same process (`vllm_mode: colocate`) or a TRL `vllm-serve` server (`vllm_mode: server`).

Reproducibility across process counts: the questions of a step are cut into generation chunks of
`generation_chunk_size // G` questions (cppo.parallel.memory derives the chunk size from the memory budget
unless it is set), and each chunk samples with its own generator seeded from
(seed, round, index of the chunk's first question in the *global* step batch). A question's
completions therefore depend on the seed, the round, its place in the global batch and the chunk
size only, not on how many processes share the step: 2 processes x Q/2 questions sample exactly
what 1 process x Q questions samples, given the same generation_chunk_size (and a multiple of it
per process).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from cppo.algorithm.allocation import questions_per_chunk
from cppo.models.lean import lean_forward_for
from cppo.models.loading import torch_dtype
from cppo.sampling.batches import Completions, PromptBatch, concat_completions
from cppo.sampling.sampler import Decoding, chunk_seed, sample_completions
from cppo.sampling.settings import BackendSettings, SamplingSettings
from cppo.sampling.speculative import Speculation

if TYPE_CHECKING:
    from cppo.config.sections import SamplingSection


class GenerationBackend(Protocol):
    """What the trainer calls on a backend. The vLLM backend also samples token contexts for the
    tool loop (`sample_contexts`, `max_model_len`)."""

    def generate(self, prompts: PromptBatch, *, round_index: int, question_offset: int = 0,
                 num_generations: int | None = None, stage: int = 1) -> Completions:
        """num_generations (None: the config's G) completions for each prompt (question-major
        rows q*G + g); stage 2 (two_stage_generations' second stage) samples from its own seeds."""

    def sync_weights(self, round_index: int, probe: list[int]) -> None:
        """Make the policy's current weights the sampler's for this round (once per round)."""

    def rest(self) -> None:
        """After a round's sampling: release what the sampler holds until the next round."""

    def close(self) -> None:
        """End the sampler (its engine, its connection)."""


class TransformersBackend:
    """Sample with the policy (any transformers causal LM) through cppo.sampling.sampler's sampler."""

    def __init__(self, model, tokenizer, settings: BackendSettings, chunk_size: int | None = None,
                 sampling: SamplingSettings | None = None, generation_dtype: str | None = "config"
                 ) -> None:
        """settings: the run's (its generation section, seed, lean_forward); generation_dtype:
        the resolved dtype of the sampling copy (None: the policy's own; "config": the
        generation section's, which must not be "auto" then)."""
        self.model, self.tokenizer, self.settings = model, tokenizer, settings
        self.chunk_size = chunk_size   # completions decoded together (None: all at once)
        self.sampling = sampling or SamplingSettings.of(settings.generation)
        self.generation_dtype = settings.generation.generation_dtype \
            if generation_dtype == "config" else generation_dtype
        self.record_logprobs = False   # asynchronous rollouts: the behaviour log-probs, always

    def sync_weights(self, round_index: int, probe: list[int]) -> None:
        """The sampler runs on the policy itself: nothing to push."""

    def rest(self) -> None:
        """Nothing held between rounds."""

    def close(self) -> None:
        """Nothing to end."""

    def questions_per_chunk(self, num_questions: int, group_size: int | None = None) -> int:
        return questions_per_chunk(self.chunk_size,
                                   group_size or self.settings.generation.num_generations,
                                   num_questions)

    def generate(self, prompts: PromptBatch, *, round_index: int, question_offset: int = 0,
                 num_generations: int | None = None, stage: int = 1) -> Completions:
        """num_generations: completions per prompt (None: the generation section's); stage 2
        (the second stage of two_stage_generations) samples from its own seeds."""
        settings, generation, tok = self.settings, self.settings.generation, self.tokenizer
        group = num_generations or generation.num_generations
        round_key = round_index if stage == 1 else f"{round_index}/stage{stage}"
        device = next(self.model.parameters()).device
        per_chunk = self.questions_per_chunk(len(prompts), group)
        decoding = Decoding(lean=settings.lean_forward, dtype=torch_dtype(self.generation_dtype),
                            speculative=speculation(generation),
                            share_prefixes=generation.share_prefixes,
                            record_logprobs=self.record_logprobs)
        parts = []
        was_training = self.model.training
        # dropout off for sampling; the lean forward has none, so the mode is left as it is
        toggle = was_training and not (settings.lean_forward and
                                       lean_forward_for(self.model)[0] is not None)
        if toggle:
            self.model.eval()
        try:
            for start in range(0, len(prompts), per_chunk):
                generator = torch.Generator(device=device).manual_seed(
                    chunk_seed(settings.seed, round_key, question_offset + start))
                chunk = prompts.select(slice(start, start + per_chunk))
                parts.append(sample_completions(
                    self.model, chunk, num_generations=group,
                    max_new_tokens=generation.max_completion_length, eos_token_id=tok.eos_token_id,
                    pad_token_id=tok.pad_token_id, sampling=self.sampling,
                    generator=generator, decoding=decoding))
        finally:
            if toggle:
                self.model.train(was_training)
        return concat_completions(parts, tok.pad_token_id)


def speculation(generation: SamplingSection) -> Speculation | None:
    """The built-in sampler's speculative settings from the config's generation section (None:
    off)."""
    k = getattr(generation, "num_speculative_tokens", 0)
    return Speculation(k, generation.prompt_lookup_max, generation.prompt_lookup_min) if k else None


def speculation_slots(generation: SamplingSection) -> int:
    """Extra KV-cache slots per completion the speculative sampler keeps for rejected drafts."""
    spec = speculation(generation)
    return spec.slack if spec is not None else 0


def make_backend(model, tokenizer, settings: BackendSettings, chunk_size: int | None = None,
                 sampling: SamplingSettings | None = None,
                 generation_dtype: str | None = "config", *,
                 push_weights: bool = True) -> GenerationBackend:
    """settings: the run's (settings.vllm.use_vllm picks vLLM). chunk_size: completions the
    built-in sampler decodes together (the trainer derives it from the memory budget); vLLM
    schedules its own batches. sampling: the settings every sampler draws with (None: the
    generation section's); generation_dtype: the resolved sampling dtype; push_weights: vLLM
    takes the policy's weights before each round (False under async_rollout: the generator
    pushes them)."""
    sampling = sampling or SamplingSettings.of(settings.generation)
    if settings.vllm.use_vllm:   # vllm_mode picks the engine's backend or the server's
        from cppo.sampling.vllm import vllm_backend_class
        return vllm_backend_class(settings.vllm)(model, tokenizer, settings, sampling=sampling,
                                                 push_weights=push_weights)
    return TransformersBackend(model, tokenizer, settings, chunk_size, sampling, generation_dtype)
