"""cppo's sampling in vLLM's terms, both ways: the request's arguments (sampling_kwargs, for an
engine's SamplingParams and a server's generate), the ids that end a completion (eos_token_ids),
and what comes back, as cppo's completions with each token's log-prob (sampled_logprobs,
completions_with_logprobs)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from cppo.sampling.batches import Completions, completions_from_token_lists
from cppo.sampling.settings import SamplingSettings

if TYPE_CHECKING:
    from cppo.config.sections import SamplingSection


def sampling_kwargs(generation: SamplingSection, sampling: SamplingSettings | None = None
                    ) -> dict:
    """vLLM SamplingParams (and TRL server) arguments for one prompt's G completions. logprobs=0
    returns the sampled token's log-prob (after the repetition penalty, temperature, top-k, top-p,
    min-p: the engine runs with logprobs_mode='processed_logprobs'), which the importance-sampling
    correction needs. sampling: the run's settings (None: the generation section's)."""
    return dict(n=generation.num_generations,
                **(sampling or SamplingSettings.of(generation)).vllm_kwargs(),
                max_tokens=generation.max_completion_length, logprobs=0)


def sampled_logprobs(token_ids: list[int], logprobs) -> list[float]:
    """The log-prob of each sampled token from vLLM's per-position {token_id: Logprob} dicts."""
    return [float(step[tok].logprob) for tok, step in zip(token_ids, logprobs)]


def completions_with_logprobs(token_lists: list[list[int]], logprob_lists: list[list[float]] | None,
                              eos_token_id, pad_token_id: int, max_new_tokens: int,
                              device=None) -> Completions:
    """completions_from_token_lists plus the sampler's log-probs (N, T), 0 after the last token."""
    out = completions_from_token_lists(token_lists, eos_token_id, pad_token_id, max_new_tokens)
    if logprob_lists is not None:
        logprobs = torch.zeros(out.ids.shape, dtype=torch.float32)
        for row, values in enumerate(logprob_lists):
            n = int(out.mask[row].sum())
            if len(values) < n:
                raise ValueError(f"vLLM returned {len(values)} log-probs for a completion of {n} "
                                 f"tokens (row {row})")
            logprobs[row, :n] = torch.tensor(values[:n], dtype=torch.float32)
        out.logprobs = logprobs
    return Completions(out.ids.to(device), out.mask.to(device), out.truncated.to(device),
                       None if out.logprobs is None else out.logprobs.to(device))


def eos_token_ids(model, tokenizer) -> list[int]:
    """Every id that ends a completion under vLLM: the tokenizer's EOS and generation_config's
    (vLLM stops on both; cppo marks a completion ending on any of them as not truncated)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    extra = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update([extra] if isinstance(extra, int) else (extra or []))
    return sorted(ids)

