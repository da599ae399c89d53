"""Sampling completions with any transformers causal LM.

The G completions of a question share its prompt, so the prompt is run through the model once
per question (prefill), and then all Q*G completions are decoded together, one token per forward
pass, with a cache; completions that have drawn the same tokens so far are decoded as one
sequence until they differ (share_prefixes). `transformers.generate` with
`num_return_sequences=G` instead repeats the prompt G times before the prefill.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from cppo.algorithm.allocation import questions_per_chunk
from cppo.models.lean import lean_forward_for
from cppo.sampling.batches import (Completions, DecodeStats, PromptBatch, concat_completions,
                                   completions_from_ids)
from cppo.sampling.logits import greedy_logits, mark_seen, sample_logits, sampling_logits, seen_tokens
from cppo.sampling.padding import pad_token_lists
from cppo.sampling.settings import SampleRequest, SamplingSettings

if TYPE_CHECKING:
    from cppo.sampling.speculative import Speculation


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
    rows: list = [None] * len(texts)
    # chat templates already contain the BOS text; plain prompts get the tokenizer's specials.
    # One tokenizer call per kind (a fast tokenizer encodes a list in one call)
    for chat in (False, True):
        which = [i for i, p in enumerate(prompts) if isinstance(p, str) != chat]
        if which:
            encoded = tokenizer([texts[i] for i in which], add_special_tokens=not chat)["input_ids"]
            for i, ids in zip(which, encoded):
                rows[i] = ids[-max_prompt_length:] if max_prompt_length is not None and \
                    len(ids) > max_prompt_length else ids
    return PromptBatch(*pad_token_lists(rows, tokenizer.pad_token_id, side="left"))


def prompts_length(tokenizer, rows: list[dict], max_prompt_length: int | None = None) -> int:
    """The padded length of the rows' encoded prompts (at most max_prompt_length): what memory
    planning sizes a round's prompts by."""
    return encode_prompts(tokenizer, [r["prompt"] for r in rows], max_prompt_length).ids.shape[1]


@dataclass(frozen=True)
class Decoding:
    """How sample_completions decodes. batch_size bounds the number of completions decoded
    together (None: all Q*G at once). lean: use cppo.models.lean's forward when it supports the
    model (same logits up to rounding). dtype: sample from a copy of the weights in this dtype
    (e.g. bfloat16: faster on CPUs with AVX512-BF16/AMX and on GPUs; lean forward only) and record
    each token's log-prob under it (Completions.logprobs) so that the trainer can correct for the
    mismatch. speculative: a Speculation, to draft tokens by n-gram look-up and verify them with
    the policy (cppo.sampling.speculative; the same distribution, fewer forwards; lean forward
    only). share_prefixes: completions of a question that are identical so far (the same tokens
    drawn) are decoded as one sequence until they differ, each still drawing its own next token
    from that sequence's distribution: the same distribution, fewer rows per forward (_decode).
    record_logprobs: record the log-probs in any dtype (asynchronous rollouts: the behaviour
    policy's)."""

    batch_size: int | None = None
    lean: bool = True
    dtype: torch.dtype | None = None
    speculative: Speculation | None = None
    share_prefixes: bool = True
    record_logprobs: bool = False


def _next_tokens(logits: Tensor, request: SampleRequest, *, logprobs: list | None = None,
                 seen: Tensor | None = None, workspace: Tensor | None = None) -> Tensor:
    """Sample (or argmax) one token per row of logits (N, V) after the logit transforms of
    cppo.sampling.logits (request.sampling; seen (N, V): the tokens the repetition penalty looks
    at); append their log-probs under the sampling distribution to `logprobs` when given.
    workspace (>= N, V) float32: a buffer for the sampling weights, reused from step to step."""
    if request.greedy:
        return greedy_logits(logits, repetition_penalty=request.sampling.repetition_penalty,
                             seen=seen).argmax(-1)
    tok, logp = sample_logits(sampling_logits(logits, seen=seen, **request.sampling.kwargs()),
                              request.generator,
                              out=None if workspace is None else workspace[:len(logits)],
                              logprobs=logprobs is not None)
    if logprobs is not None:
        logprobs.append(logp)
    return tok


@torch.no_grad()
def sample_completions(model, prompts: PromptBatch, *, num_generations: int, max_new_tokens: int,
                       eos_token_id: int | Sequence[int], pad_token_id: int,
                       sampling: SamplingSettings = SamplingSettings(), greedy: bool = False,
                       generator: torch.Generator | None = None,
                       decoding: Decoding = Decoding()) -> Completions:
    """G completions for each of Q prompts (ids and mask (Q, Lp)): prefill each prompt once,
    share its KV cache. Returns Completions of Q*G question-major rows (ids and mask (Q*G, T)).

    sampling: the logit transforms (temperature, top_k, top_p, min_p, repetition_penalty over the
    prompt's and the completion's tokens) as transformers' generate applies them
    (cppo.sampling.logits); greedy: the argmax (after the repetition penalty) instead of a draw
    from `generator`. decoding: how the completions are decoded (Decoding: chunking, the lean
    forward, the sampling dtype, speculative sampling, shared prefixes, recorded log-probs)."""
    q = len(prompts)
    per_chunk = questions_per_chunk(decoding.batch_size, num_generations, q)
    lean, dtype, speculative = decoding.lean, decoding.dtype, decoding.speculative
    lean_forward = lean_forward_for(model)[0] if lean else None
    if dtype is not None and lean_forward is None:
        raise ValueError(f"sampling in {dtype} needs the lean forward, which does not support this "
                         f"model: {lean_forward_for(model)[1] if lean else 'lean=False'}")
    if speculative is not None and lean_forward is None:
        raise ValueError(f"speculative sampling (num_speculative_tokens={speculative.num_tokens}) "
                         f"needs the lean forward, which does not support this model: "
                         f"{lean_forward_for(model)[1] if lean else 'lean=False'}")
    request = SampleRequest(num_generations, max_new_tokens, eos_token_id, pad_token_id, sampling,
                            greedy, generator,
                            record=decoding.record_logprobs or dtype is not None,
                            share=decoding.share_prefixes and num_generations > 1)
    sample_chunk = (functools.partial(_sample_chunk, model) if lean_forward is None
                    else functools.partial(_sample_chunk_lean, lean_forward, dtype, speculative))
    parts = [sample_chunk(prompts.select(slice(s, s + per_chunk)), request)
             for s in range(0, q, per_chunk)]
    return concat_completions(parts, pad_token_id)


def _cache_kwarg(model) -> str:
    """transformers >= 5.2x names the KV cache argument `cache`; older releases `past_key_values`."""
    import inspect
    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _prompt_tokens_seen(prompts: PromptBatch, num_generations: int, vocab_size: int,
                        sampling: SamplingSettings) -> Tensor | None:
    """(Q*G, V) the prompt tokens the repetition penalty starts from (None: no penalty)."""
    if sampling.repetition_penalty == 1.0:
        return None
    return seen_tokens(prompts.ids, prompts.mask, vocab_size).repeat_interleave(num_generations, 0)


def _sample_chunk(model, prompts: PromptBatch, request: SampleRequest) -> Completions:
    """Prefill with the model's own forward, then decode with it: the G completions start as one
    sequence per question (request.share) or as G copies of its cache."""
    num_generations = request.num_generations
    device = next(model.parameters()).device
    prompts = prompts.to(device)
    positions = (prompts.mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=prompts.ids, attention_mask=prompts.mask, position_ids=positions,
                use_cache=True, logits_to_keep=1)
    cache_arg = _cache_kwarg(model)
    cache = getattr(out, cache_arg)
    compact = hasattr(cache, "batch_select_indices")
    share = request.share and compact   # shared sequences are picked with batch_select_indices
    copies = 1 if share else num_generations
    if copies > 1:
        cache.batch_repeat_interleave(copies)
    state = {"attention": prompts.mask.repeat_interleave(copies, 0),
             "position": positions[:, -1:].repeat_interleave(copies, 0) + 1}

    def advance(tok: Tensor, rows: Tensor | None) -> Tensor:
        if rows is not None:   # the sequences to continue, as rows of the batch and the cache
            cache.batch_select_indices(rows)
            state["attention"], state["position"] = state["attention"][rows], state["position"][rows]
        state["attention"] = F.pad(state["attention"], (0, 1), value=1)
        out = model(input_ids=tok[:, None], attention_mask=state["attention"],
                    position_ids=state["position"], use_cache=True, **{cache_arg: cache})
        state["position"] = state["position"] + 1
        return out.logits[:, -1]
    first = out.logits[:, -1]
    seen = _prompt_tokens_seen(prompts, num_generations, first.shape[-1], request.sampling)
    return _decode(first.repeat_interleave(copies, 0), advance, request, request.eos(device),
                   compact=compact, seen=seen,
                   sequence_of=_question_rows(len(prompts), num_generations, first.device) if share else None)


def _sample_chunk_lean(lean, dtype: torch.dtype | None, speculative: Speculation | None,
                       prompts: PromptBatch, request: SampleRequest) -> Completions:
    """_sample_chunk on cppo.models.lean's forward (weights cast to `dtype` if given, and then
    each token's sampler log-prob recorded), with a preallocated KV cache; with `speculative`
    (a Speculation), decoding drafts and verifies several tokens per forward."""
    num_generations, device = request.num_generations, lean.device
    prompts = prompts.to(device)
    width = prompts.ids.shape[1]
    positions = (prompts.mask.cumsum(-1) - 1).clamp(min=0)
    capacity = width + request.max_new_tokens + (speculative.slack if speculative is not None else 0)
    share = request.share and speculative is None
    copies = 1 if share else num_generations    # shared: the G rows start as one sequence
    with lean.frozen(dtype):
        logits, cache = lean(prompts.ids, positions, prompts.mask.bool(), logits_to_keep=1,
                             new_cache_capacity=width)
        cache = cache.repeat_interleave(copies, capacity)
        keys = torch.ones(len(prompts) * copies, capacity, dtype=torch.bool, device=device)
        keys[:, :width] = prompts.mask.bool().repeat_interleave(copies, 0)
        state = {"position": positions[:, -1:].repeat_interleave(copies, 0) + 1,
                 "cache": cache, "keys": keys}
        if speculative is not None:
            from cppo.sampling.speculative import speculative_decode
            return speculative_decode(
                lean, logits[:, -1].repeat_interleave(num_generations, 0), cache, keys,
                state["position"], prompts.ids.repeat_interleave(num_generations, 0),
                prompts.mask.repeat_interleave(num_generations, 0), request, speculative)

        def advance(tok: Tensor, rows: Tensor | None) -> Tensor:
            if rows is not None:   # the sequences to continue, as rows of the batch and the cache
                state["cache"] = state["cache"].select_rows(rows)
                state["keys"], state["position"] = state["keys"][rows], state["position"][rows]
            logits, _ = lean(tok[:, None], state["position"], state["keys"], cache=state["cache"])
            state["position"] = state["position"] + 1
            return logits[:, -1]
        seen = _prompt_tokens_seen(prompts, num_generations, logits.shape[-1], request.sampling)
        return _decode(logits[:, -1].repeat_interleave(copies, 0), advance, request,
                       request.eos(device), compact=True, seen=seen,
                       sequence_of=_question_rows(len(prompts), num_generations, device) if share else None)


def _question_rows(num_questions: int, num_generations: int, device) -> Tensor:
    """(Q*G,) the question of each row of a question-major batch: its sequence before any token."""
    return torch.arange(num_questions, device=device).repeat_interleave(num_generations)


SHARE_WHILE = 0.75   # prefixes stay shared while the distinct sequences are at most this fraction
                     # of the rows still decoding; then each row becomes its own sequence


def _counting(advance, stats: DecodeStats):
    """advance, counting the sequences each decode step runs into stats."""
    def counted(tokens: Tensor, rows: Tensor | None) -> Tensor:
        stats.sequences += len(tokens)
        return advance(tokens, rows)
    return counted


def _advance_shared(advance, sequence_of: Tensor, tok: Tensor, finished: Tensor, active: Tensor,
                    seen: Tensor | None, vocab: int, in_batch: int):
    """One decode step for rows that share sequences: live rows that drew the same token from
    the same sequence continue one sequence (the next forward runs once for them); once the
    distinct sequences exceed SHARE_WHILE of the live rows, every live row becomes its own
    sequence (sequence_of None) and the finished rows leave. Returns the next logits,
    sequence_of, active, finished and seen."""
    live = (~finished).nonzero().squeeze(1)
    # a continued sequence: (the sequence a live row was on, the token it drew)
    continued, inverse = torch.unique(sequence_of[live] * vocab + tok[live], return_inverse=True)
    if len(continued) <= SHARE_WHILE * len(live):
        sequence_of = torch.zeros_like(sequence_of).index_put_((live,), inverse)
        logits = advance(continued % vocab, continued // vocab)   # finished rows: any
        return logits, sequence_of, active, finished, seen
    rows = sequence_of[live]
    active, tok, finished = active[live], tok[live], finished[live]
    seen = seen[live] if seen is not None else None
    same = len(rows) == in_batch and bool((rows == torch.arange(len(rows), device=rows.device)).all())
    return advance(tok, None if same else rows), None, active, finished, seen


def _decode(logits: Tensor, advance, request: SampleRequest, eos: Tensor, *, compact: bool,
            seen: Tensor | None = None, sequence_of: Tensor | None = None) -> Completions:
    """Sample up to request.max_new_tokens tokens per row from first logits (M, V) of M
    sequences (the model's batch holds sequences, the output rows). sequence_of (N,): the
    sequence each of the N rows continues (its logits are the sequence's), None: row n is
    sequence n (M = N); with it, rows that drew the same token from the same sequence continue one sequence
    (_advance_shared), each still drawing its own token. advance(tokens (m,), rows) runs one
    decode step and returns the next logits (m, V) of the batch's sequences: rows (m,) is None
    (the batch as it is) or the positions in the current batch of the sequences to continue (a
    gather: a position may repeat, a finished row's sequence may be left out). Without sharing
    and with `compact`, finished rows leave the batch once they are an eighth of it. Finished
    rows get padding; request.record keeps each token's log-prob under the sampling
    distribution. eos (E,): the end-of-sequence ids on the logits' device. seen (N, V): the
    tokens the repetition penalty looks at (None: no penalty)."""
    max_new_tokens, pad_token_id = request.max_new_tokens, request.pad_token_id
    n = len(sequence_of) if sequence_of is not None else logits.shape[0]
    device, vocab = logits.device, logits.shape[-1]
    ids = torch.full((n, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    recorded = torch.zeros(n, max_new_tokens, device=device) \
        if request.record and not request.greedy else None
    active = torch.arange(n, device=device)          # the row of ids each batch row fills
    finished = torch.zeros(n, dtype=torch.bool, device=device)   # per batch row
    width = 0
    workspace = None if request.greedy else torch.empty(n, vocab, device=device)
    stats = DecodeStats() if sequence_of is not None else None
    if stats is not None:
        advance = _counting(advance, stats)
    for step in range(max_new_tokens):
        logprobs = [] if recorded is not None else None
        in_batch = logits.shape[0]   # the sequences of the model's batch
        row_logits = logits if sequence_of is None else logits.index_select(0, sequence_of)
        logits = None   # freed before the next forward: at most one step's logits exist at once
        tok = _next_tokens(row_logits, request, logprobs=logprobs, seen=seen, workspace=workspace)
        del row_logits
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
        if stats is not None:
            stats.rows += len(finished) - done
        if sequence_of is not None:
            logits, sequence_of, active, finished, seen = _advance_shared(
                advance, sequence_of, tok, finished, active, seen, vocab, in_batch)
            continue
        rows = None
        if compact and done and 8 * done >= len(finished):
            rows = (~finished).nonzero().squeeze(1)
            active, tok, finished = active[rows], tok[rows], finished[rows]
            seen = seen[rows] if seen is not None else None
        logits = advance(tok, rows)
    completions = completions_from_ids(ids[:, :width], eos)
    if recorded is not None:
        completions.logprobs = recorded[:, :width] * completions.mask
    completions.decode = stats
    return completions


def chunk_seed(seed: int, round_index: int, question_offset: int, turn: int = 0) -> int:
    """A 63-bit seed for the chunk of a round that starts at global question `question_offset`;
    turn > 0: for a later model turn of a multi-turn rollout (cppo.sampling.tools), apart."""
    key = f"cppo/{seed}/{round_index}/{question_offset}" + (f"/turn{turn}" if turn else "")
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


