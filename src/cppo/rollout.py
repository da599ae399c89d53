"""Sampling completions and scoring their log-probabilities with any transformers causal LM.

The G completions of a question share its prompt, so the prompt is run through the model once
per question (prefill), its key/value cache is repeated G times, and then all Q*G completions are
decoded together, one token per forward pass, with a cache. `transformers.generate` with
`num_return_sequences=G` instead repeats the prompt G times before the prefill.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from cppo.models.lean import lean_forward_for
from cppo.padding import pad_token_lists
from cppo.sampling.logits import (filter_logits, greedy_logits, mark_seen,  # noqa: F401 (re-export)
                                  sampling_logits, seen_tokens)


@dataclass
class PromptBatch:
    """Left-padded prompts: ids and mask (Q, Lp)."""

    ids: Tensor
    mask: Tensor

    def __len__(self) -> int:
        return self.ids.shape[0]

    def select(self, index: Tensor) -> "PromptBatch":
        return PromptBatch(self.ids[index], self.mask[index])

    def to(self, device) -> "PromptBatch":
        return PromptBatch(self.ids.to(device), self.mask.to(device))


@dataclass
class Completions:
    """Sampled completions, question-major: row q*G + g is completion g of question q.

    ids (N, T) padded after EOS; mask (N, T) 1 on tokens up to and including EOS;
    truncated (N,) True where no EOS was produced within the length limit; logprobs (N, T), when
    the sampler recorded them: log-probability of each token under the distribution it was drawn
    from (after temperature, top-k, top-p; 0 after EOS); tool_mask (N, T), for multi-turn
    completions (cppo.sampling.multi_turn): 0 on the tokens a tool or environment wrote (in the
    context, out of the loss), 1 elsewhere."""

    ids: Tensor
    mask: Tensor
    truncated: Tensor
    logprobs: Tensor | None = None
    tool_mask: Tensor | None = None

    @property
    def lengths(self) -> Tensor:
        return self.mask.sum(-1)


def prompt_text(tokenizer, prompt) -> str:
    """A row's prompt as text: chat messages go through the tokenizer's chat template."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt):
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the prompt is a list of chat messages but the tokenizer has no "
                             "chat_template; give plain-text prompts or a chat model")
        return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    raise ValueError(f"a prompt must be a string or a list of chat messages, got {type(prompt).__name__}")


def encode_prompts(tokenizer, prompts: Sequence, max_prompt_length: int | None = None) -> PromptBatch:
    """Tokenise and left-pad prompts; left-truncate to max_prompt_length tokens."""
    texts = [prompt_text(tokenizer, p) for p in prompts]
    chat = [not isinstance(p, str) for p in prompts]
    rows = []
    for text, is_chat in zip(texts, chat):
        # chat templates already contain the BOS text; plain prompts get the tokenizer's specials
        ids = tokenizer(text, add_special_tokens=not is_chat)["input_ids"]
        if max_prompt_length is not None and len(ids) > max_prompt_length:
            ids = ids[-max_prompt_length:]
        rows.append(ids)
    return PromptBatch(*pad_token_lists(rows, tokenizer.pad_token_id, side="left"))


def _next_tokens(logits: Tensor, *, greedy: bool, generator: torch.Generator | None,
                 logprobs: list | None = None, seen: Tensor | None = None, **transforms) -> Tensor:
    """Sample (or argmax) one token per row of logits (N, V) after the logit transforms of
    cppo.sampling.logits (`transforms`: temperature, top_k, top_p, min_p, repetition_penalty; seen
    (N, V): the tokens the repetition penalty looks at); append their log-probs under the
    sampling distribution to `logprobs` when given."""
    if greedy:
        return greedy_logits(logits, repetition_penalty=transforms["repetition_penalty"],
                             seen=seen).argmax(-1)
    logits = sampling_logits(logits, seen=seen, **transforms)
    tok = sample_categorical(logits.softmax(-1), generator)
    if logprobs is not None:
        logprobs.append(torch.log_softmax(logits, -1).gather(-1, tok[:, None]).squeeze(-1))
    return tok


def sample_categorical(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One draw (N,) from each row of probs (N, V) (non-negative weights, rows need not sum to 1)
    by inverting its cumulative distribution.

    One uniform number per row, against V per row for torch.multinomial (which runs an
    exponential race): far less work for large vocabularies. Tokens of weight 0 are never drawn."""
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    if not bool((torch.isfinite(total) & (total > 0)).all()):
        raise ValueError("cannot sample: a row of the sampling distribution is not finite or is "
                         "all zero (the model's logits hold NaN or inf)")
    device = generator.device if generator is not None else probs.device
    u = torch.rand(probs.shape[0], 1, generator=generator, device=device).to(probs.device)
    # u < 1, so u * total < total: the index is always a token of nonzero weight
    return torch.searchsorted(cdf, u * total, right=True).squeeze(-1)


@torch.no_grad()
def sample_completions(model, prompts: PromptBatch, *, num_generations: int, max_new_tokens: int,
                       eos_token_id: int | Sequence[int], pad_token_id: int, temperature: float = 1.0,
                       top_p: float = 1.0, top_k: int = 0, greedy: bool = False,
                       generator: torch.Generator | None = None, min_p: float | None = None,
                       repetition_penalty: float = 1.0,
                       batch_size: int | None = None, lean: bool = True,
                       dtype: torch.dtype | None = None) -> Completions:
    """G completions for each of Q prompts: prefill each prompt once, share its KV cache.

    batch_size bounds the number of completions decoded together (None: all Q*G at once).
    min_p, repetition_penalty (over the prompt's and the completion's tokens): as transformers'
    generate applies them (cppo.sampling.logits).
    lean: use cppo.models.lean's forward when it supports the model (same logits up to rounding).
    dtype: sample from a copy of the weights in this dtype (e.g. bfloat16: faster on CPUs with
    AVX512-BF16/AMX and on GPUs; lean forward only) and record each token's log-prob under it
    (Completions.logprobs) so that the trainer can correct for the mismatch."""
    q = len(prompts)
    per_chunk = q if batch_size is None else max(1, batch_size // num_generations)
    lean_forward = lean_forward_for(model)[0] if lean else None
    if dtype is not None and lean_forward is None:
        raise ValueError(f"sampling in {dtype} needs the lean forward, which does not support this "
                         f"model: {lean_forward_for(model)[1] if lean else 'lean=False'}")
    sample_chunk = (_sample_chunk if lean_forward is None
                    else functools.partial(_sample_chunk_lean, lean_forward, dtype))
    transforms = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                      repetition_penalty=repetition_penalty)
    parts = [sample_chunk(model, prompts.select(slice(s, s + per_chunk)), num_generations,
                          max_new_tokens, eos_token_id, pad_token_id, greedy, generator, transforms)
             for s in range(0, q, per_chunk)]
    return concat_completions(parts, pad_token_id)


def concat_completions(parts: list[Completions], pad_token_id: int) -> Completions:
    """Stack completion batches of different lengths (right-padded to the longest)."""
    if len(parts) == 1:
        return parts[0]
    width = max(p.ids.shape[1] for p in parts)
    logprobs = None
    if all(p.logprobs is not None for p in parts):
        logprobs = torch.cat([F.pad(p.logprobs, (0, width - p.logprobs.shape[1])) for p in parts])
    return Completions(
        ids=torch.cat([F.pad(p.ids, (0, width - p.ids.shape[1]), value=pad_token_id) for p in parts]),
        mask=torch.cat([F.pad(p.mask, (0, width - p.mask.shape[1])) for p in parts]),
        truncated=torch.cat([p.truncated for p in parts]), logprobs=logprobs)


def _cache_kwarg(model) -> str:
    """transformers >= 5.2x names the KV cache argument `cache`; older releases `past_key_values`."""
    import inspect
    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _eos_tensor(eos_token_id: int | Sequence[int], device) -> Tensor:
    return torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id),
                        device=device)


def _prompt_tokens_seen(prompts: PromptBatch, num_generations: int, vocab_size: int,
                        transforms: dict) -> Tensor | None:
    """(Q*G, V) the prompt tokens the repetition penalty starts from (None: no penalty)."""
    if transforms["repetition_penalty"] == 1.0:
        return None
    return seen_tokens(prompts.ids, prompts.mask, vocab_size).repeat_interleave(num_generations, 0)


def _sample_chunk(model, prompts, num_generations, max_new_tokens, eos_token_id, pad_token_id, greedy,
                  generator, transforms) -> Completions:
    """Prefill with the model's own forward, repeat its cache G times, decode with it."""
    device = next(model.parameters()).device
    prompts = prompts.to(device)
    positions = (prompts.mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=prompts.ids, attention_mask=prompts.mask, position_ids=positions,
                use_cache=True, logits_to_keep=1)
    cache_arg = _cache_kwarg(model)
    cache = getattr(out, cache_arg)
    if num_generations > 1:
        cache.batch_repeat_interleave(num_generations)
    state = {"attention": prompts.mask.repeat_interleave(num_generations, 0),
             "position": positions[:, -1:].repeat_interleave(num_generations, 0) + 1}

    def advance(tok: Tensor, rows: Tensor | None) -> Tensor:
        if rows is not None:   # drop finished rows from the batch and the cache
            cache.batch_select_indices(rows)
            state["attention"], state["position"] = state["attention"][rows], state["position"][rows]
        state["attention"] = F.pad(state["attention"], (0, 1), value=1)
        out = model(input_ids=tok[:, None], attention_mask=state["attention"],
                    position_ids=state["position"], use_cache=True, **{cache_arg: cache})
        state["position"] = state["position"] + 1
        return out.logits[:, -1]
    first = out.logits[:, -1]
    return _decode(first.repeat_interleave(num_generations, 0), advance, max_new_tokens,
                   _eos_tensor(eos_token_id, device), pad_token_id, record=False,
                   compact=hasattr(cache, "batch_select_indices"), greedy=greedy,
                   generator=generator,
                   seen=_prompt_tokens_seen(prompts, num_generations, first.shape[-1], transforms),
                   **transforms)


def _sample_chunk_lean(lean, dtype, model, prompts, num_generations, max_new_tokens, eos_token_id,
                       pad_token_id, greedy, generator, transforms) -> Completions:
    """_sample_chunk on cppo.models.lean's forward (weights cast to `dtype` if given, and then
    each token's sampler log-prob recorded), with a preallocated KV cache."""
    device = lean.device
    prompts = prompts.to(device)
    width = prompts.ids.shape[1]
    positions = (prompts.mask.cumsum(-1) - 1).clamp(min=0)
    with lean.frozen(dtype):
        logits, cache = lean(prompts.ids, positions, prompts.mask.bool(), logits_to_keep=1,
                             new_cache_capacity=width)
        cache = cache.repeat_interleave(num_generations, width + max_new_tokens)
        keys = torch.ones(len(prompts) * num_generations, width + max_new_tokens, dtype=torch.bool,
                          device=device)
        keys[:, :width] = prompts.mask.bool().repeat_interleave(num_generations, 0)
        state = {"position": positions[:, -1:].repeat_interleave(num_generations, 0) + 1,
                 "cache": cache, "keys": keys}

        def advance(tok: Tensor, rows: Tensor | None) -> Tensor:
            if rows is not None:   # drop finished rows from the batch and the cache
                state["cache"] = state["cache"].select_rows(rows)
                state["keys"], state["position"] = state["keys"][rows], state["position"][rows]
            logits, _ = lean(tok[:, None], state["position"], state["keys"], cache=state["cache"])
            state["position"] = state["position"] + 1
            return logits[:, -1]
        seen = _prompt_tokens_seen(prompts, num_generations, logits.shape[-1], transforms)
        return _decode(logits[:, -1].repeat_interleave(num_generations, 0), advance, max_new_tokens,
                       _eos_tensor(eos_token_id, device), pad_token_id, record=dtype is not None,
                       compact=True, greedy=greedy, generator=generator, seen=seen, **transforms)


def _decode(logits: Tensor, advance, max_new_tokens: int, eos: Tensor, pad_token_id: int, *,
            record: bool, compact: bool, seen: Tensor | None = None, **sampling) -> Completions:
    """Sample up to max_new_tokens tokens per row from first logits (N, V).

    advance(tokens (n,), rows) runs one decode step of the n rows still in the batch and returns
    their next logits (n, V); rows (n,) is None, or the positions of the rows to keep in the
    batch (the others have produced EOS): with `compact`, finished rows leave the batch once they
    are an eighth of it, so no work is spent on them. Finished rows get padding; with `record`,
    each token's log-prob under the sampling distribution is kept. seen (N, V): the tokens the
    repetition penalty looks at (the prompt's), each sampled token added (None: no penalty)."""
    n, device = logits.shape[0], logits.device
    ids = torch.full((n, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    recorded = torch.zeros(n, max_new_tokens, device=device) if record and not sampling["greedy"] else None
    active = torch.arange(n, device=device)          # the row of ids each batch row fills
    finished = torch.zeros(n, dtype=torch.bool, device=device)   # per batch row
    width = 0
    for step in range(max_new_tokens):
        logprobs = [] if recorded is not None else None
        tok = _next_tokens(logits, logprobs=logprobs, seen=seen, **sampling)
        tok = torch.where(finished, torch.full_like(tok, pad_token_id), tok)
        if seen is not None:
            mark_seen(seen, tok)
        ids[active, step] = tok
        if logprobs is not None:
            recorded[active, step] = logprobs[0].float()
        width = step + 1
        finished |= torch.isin(tok, eos)
        done = int(finished.sum())
        if step == max_new_tokens - 1 or done == len(finished):
            break
        rows = None
        if compact and done and 8 * done >= len(finished):
            rows = (~finished).nonzero().squeeze(1)
            active, tok, finished = active[rows], tok[rows], finished[rows]
            seen = seen[rows] if seen is not None else None
        logits = advance(tok, rows)
    completions = _completions(ids[:, :width], eos)
    if recorded is not None:
        completions.logprobs = recorded[:, :width] * completions.mask
    return completions


def _completions(ids: Tensor, eos: Tensor) -> Completions:
    """Completions from sampled tokens (N, T) padded after EOS; mask 1 up to and including the first EOS."""
    is_eos = torch.isin(ids, eos)
    after_eos = (is_eos.cumsum(1) - is_eos.long()) > 0
    return Completions(ids=ids, mask=(~after_eos).long(), truncated=~is_eos.any(1))


LOGITS_CHUNK = 1024   # half-precision rows upcast to float32 at a time


def selective_log_softmax(logits: Tensor, index: Tensor) -> Tensor:
    """log_softmax(logits)[..., index] (shape of index) without materialising the full
    log-probs: logits (..., V), e.g. (N, T, V) or packed (M, V)."""
    if logits.dtype in (torch.float32, torch.float64):
        return logits.gather(-1, index.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    flat, flat_index = logits.reshape(-1, logits.shape[-1]), index.reshape(-1, 1)
    rows = [F.log_softmax(lg.float(), -1).gather(-1, ix).squeeze(-1)
            for lg, ix in zip(flat.split(LOGITS_CHUNK), flat_index.split(LOGITS_CHUNK))]
    return torch.cat(rows).view(index.shape) if rows else flat.new_zeros(index.shape, dtype=torch.float32)


def completion_logprobs(model, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
                        completion_mask: Tensor, *, temperature: float = 1.0,
                        batch_size: int | None = None, lean: bool = True,
                        entropies: list | None = None, packed: bool = True,
                        entropy_grad: bool = False) -> Tensor:
    """Per-token log-probs (N, T) of completion tokens given their prompts (N, Lp).

    Logits are divided by the sampling temperature, as TRL does. Runs with grad if enabled.
    lean: use cppo.models.lean's forward when it supports the model: each distinct prompt of a
    micro-batch is run once, and with `packed` (the default) every pass but attention, the head
    and the log-softmax run on real tokens only (log-probs and entropies are 0 where
    completion_mask is 0, which must be 1 on a prefix of each row). packed=False: the padded
    layout (for comparison). Without the lean forward, the model's own forward on padded rows
    (log-probs and entropies are 0 at padding there too). entropy_grad: the entropies carry the
    gradient (an entropy bonus in the loss); else they are detached."""
    entropy_of = differentiable_entropy if entropy_grad else (lambda lg: token_entropy(lg.detach()))
    n, t = completion_ids.shape
    step = n if batch_size is None else batch_size
    lean_forward = lean_forward_for(model)[0] if lean else None
    out = []
    for s in range(0, n, step):
        rows = slice(s, s + step)
        ids = completion_ids[rows]
        if lean_forward is not None:
            prompts, question = torch.unique(torch.cat([prompt_ids[rows], prompt_mask[rows]], dim=1),
                                             dim=0, return_inverse=True)
            width = prompt_ids.shape[1]
            logits = lean_forward.completion_logits(prompts[:, :width], prompts[:, width:], question,
                                                    ids, completion_mask[rows], packed=packed)
        else:
            ids_full = torch.cat([prompt_ids[rows], ids], dim=1)
            mask = torch.cat([prompt_mask[rows], completion_mask[rows]], dim=1)
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=ids_full, attention_mask=mask, position_ids=positions,
                           use_cache=False, logits_to_keep=t + 1).logits[:, :-1]
        if temperature != 1.0:
            logits = logits / temperature
        if lean_forward is not None and packed:   # logits (M, V) of the real tokens
            real = completion_mask[rows].bool()
            logps = selective_log_softmax(logits, ids[real])
            out.append(logps.new_zeros(ids.shape).masked_scatter(real, logps))
            if entropies is not None:
                entropy = entropy_of(logits)
                entropies.append(entropy.new_zeros(ids.shape).masked_scatter(real, entropy))
            continue
        real = completion_mask[rows].to(logits.dtype)   # 0 at padding, as on the packed path
        out.append(selective_log_softmax(logits, ids) * real)
        if entropies is not None:   # TRL's entropy metric: (rows, T) of the same logits
            entropies.append(entropy_of(logits) * real)
    return torch.cat(out)


def differentiable_entropy(logits: Tensor) -> Tensor:
    """Entropy (...) of the distributions of logits (..., V), with its gradient, in float32."""
    lg = logits.float()
    return torch.logsumexp(lg, -1) - (lg.softmax(-1) * lg).sum(-1)


@torch.no_grad()
def token_entropy(logits: Tensor) -> Tensor:
    """Entropy (...) of the distributions of logits (..., V), e.g. (N, T, V) or packed (M, V),
    LOGITS_CHUNK rows at a time."""
    flat = logits.reshape(-1, logits.shape[-1])
    rows = []
    for lg in flat.split(LOGITS_CHUNK):
        lg = lg.float()
        rows.append(torch.logsumexp(lg, -1) - (lg.softmax(-1) * lg).sum(-1))
    return torch.cat(rows).view(logits.shape[:-1]) if rows else flat.new_zeros(logits.shape[:-1], dtype=torch.float32)
