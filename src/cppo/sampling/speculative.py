"""Speculative sampling with a model-free n-gram drafter, exact for the policy's distribution.

Each decode step, every row still generating gets up to k draft tokens from an n-gram look-up:
the longest suffix of its text (n from prompt_lookup_max down to prompt_lookup_min tokens) is
searched in its own prompt and completion so far and in its siblings' completions (the other
G - 1 completions of the same question, which tend to say the same things), and the tokens that
followed a match are the draft (the match with the longest continuation, its own text first,
then the latest). The row's last token and its drafts go through the
policy in one forward (the lean forward, on the KV cache shared from the prompt's prefill), and
cppo.algorithm.speculative's accept / resample rule keeps each emitted token distributed exactly
as plain sampling would draw it.

Every row of the batch computes the same number of positions in a step, so a draft position is
verified only when at least half the rows have a draft there (quorum_width); the other rows'
drafts are cut to that length (any drafter, hence any cut, keeps the distribution exact).

The KV cache is one buffer with a single fill length for the whole batch; a row's rejected draft
positions stay in it as holes hidden by the key mask, and when the buffer fills up the visible
slots of each row are packed together (keys carry their rotary position, so slot order does not
matter beyond causality). Rows that finish leave the batch, as in plain decoding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from cppo.algorithm.speculative import (accepted_drafts, accepted_drafts_greedy,
                                        residual_weights)
from cppo.sampling.batches import Completions, completions_from_ids
from cppo.sampling.logits import sample_categorical, sample_logits, sampling_logits
from cppo.sampling.settings import SampleRequest, SamplingSettings


@dataclass
class SpeculationStats:
    """Counts over a generation: policy forwards of the decode loop (after the prefill), row
    forwards (the rows still generating in each, summed), tokens they emitted, draft tokens
    proposed and accepted."""

    forwards: int = 0
    row_forwards: int = 0
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0

    def __add__(self, other: "SpeculationStats") -> "SpeculationStats":
        return SpeculationStats(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def add_forward(self, live: Tensor, emitted: Tensor, drafted: Tensor, accepted: Tensor) -> None:
        """Count one decode forward: the rows still generating (live, bool), each row's tokens
        emitted, drafts proposed and accepted."""
        self.forwards += 1
        self.row_forwards += int(live.sum())
        self.tokens += int(emitted.sum())
        self.drafted += int(drafted[live].sum())
        self.accepted += int(accepted[live].sum())

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Tokens each completion gained per policy forward it took part in (1 without drafts)."""
        return self.tokens / self.row_forwards if self.row_forwards else 0.0

    def metrics(self) -> dict:
        return {"speculative/acceptance_rate": self.acceptance_rate,
                "speculative/tokens_per_forward": self.tokens_per_forward,
                "speculative/draft_tokens": self.drafted}


def ngram_drafts(context: Tensor, real: Tensor, ends: Tensor, rows: Tensor, group_size: int,
                 num_tokens: int, budget: Tensor, max_ngram: int, min_ngram: int) -> tuple[Tensor, Tensor]:
    """Draft tokens for `rows` from an n-gram look-up in their own and their siblings' text.

    context (N, L): every row's text (left-padded prompt, then its completion so far); real (N, L)
    bool: which entries are text; ends (N,): one past each row's last token; rows (n,): the rows
    to draft for; group_size: rows g*G .. g*G+G-1 are siblings; budget (n,): the most drafts each
    may take. The suffix of a row's last n tokens is matched in every sibling's text (its own
    included), longest n first; among the matches, the one followed by the most tokens (up to
    num_tokens), then the row's own text, then the latest; the draft is what followed it. Returns drafts (n, num_tokens) and their counts (n,) (0: no match)."""
    n_rows, width = len(rows), context.shape[1]
    device = context.device
    drafts = torch.zeros(n_rows, num_tokens, dtype=torch.long, device=device)
    counts = torch.zeros(n_rows, dtype=torch.long, device=device)
    if n_rows == 0 or num_tokens == 0:
        return drafts, counts
    first = (rows // group_size) * group_size
    siblings = first[:, None] + torch.arange(group_size, device=device)           # (n, G)
    sib_text, sib_real, sib_ends = context[siblings], real[siblings], ends[siblings]
    own = siblings == rows[:, None]                                                # (n, G)
    row_ends = ends[rows]
    found = torch.zeros(n_rows, dtype=torch.bool, device=device)
    for size in range(max_ngram, min_ngram - 1, -1):
        places = width - size                    # windows whose next token is inside the buffer
        if places <= 0:
            continue
        starts = (row_ends - size).clamp(min=0)
        suffix = context[rows[:, None], starts[:, None] + torch.arange(size, device=device)]
        has_suffix = (row_ends >= size) & real[rows[:, None], starts[:, None]
                                                 + torch.arange(size, device=device)].all(1)
        match = torch.ones(n_rows, group_size, places, dtype=torch.bool, device=device)
        for j in range(size):
            match &= (sib_text[:, :, j:j + places] == suffix[:, j, None, None]) & sib_real[:, :, j:j + places]
        position = torch.arange(places, device=device)
        follow = (sib_ends[:, :, None] - (position + size)[None, None]).clamp(max=num_tokens)
        match &= follow > 0                                              # something follows it
        match &= has_suffix[:, None, None] & ~found[:, None, None]
        score = follow * 2 * width + own[:, :, None].long() * width + position
        score = torch.where(match, score, -1)
        best = score.flatten(1).max(1)
        hit = best.values >= 0
        if not bool(hit.any()):
            continue
        source = siblings.gather(1, (best.indices // places)[:, None]).squeeze(1)   # (n,)
        start = best.indices % places + size
        available = ends[source] - start
        take = torch.minimum(torch.minimum(available, budget), torch.full_like(budget, num_tokens))
        take = torch.where(hit, take.clamp(min=0), 0)
        index = (start[:, None] + torch.arange(num_tokens, device=device)).clamp(max=width - 1)
        drafts = torch.where(hit[:, None], context[source[:, None], index], drafts)
        counts = torch.where(hit, take, counts)
        found |= hit
        if bool(found.all()):
            break
    drafts = torch.where(torch.arange(num_tokens, device=device)[None] < counts[:, None], drafts, 0)
    return drafts, counts


DRAFT_QUORUM = 0.5   # a draft position is verified only if this share of the rows has a draft there


def quorum_width(counts: Tensor) -> int:
    """Draft positions to verify this step, from the drafts each row has (n,): the largest w
    such that DRAFT_QUORUM of the rows have at least w. Every row of the batch computes w + 1
    positions, so a position few rows have a draft for costs the whole batch for little gain."""
    if len(counts) == 0:
        return 0
    ranked = counts.sort(descending=True).values
    return int(ranked[max(0, math.ceil(DRAFT_QUORUM * len(counts)) - 1)])


def pack_cache(cache, keys: Tensor) -> Tensor:
    """Move each row's visible cache slots (keys (n, C) bool, up to cache.length) to the front of
    the buffer, right-aligned to the longest row; sets cache.length and returns the new keys."""
    visible = keys[:, :cache.length]
    kept = int(visible.sum(1).max())
    order = torch.sort(visible.to(torch.int8), dim=1, stable=True).indices[:, -kept:]   # (n, kept)
    for buffers in (cache.keys, cache.values):
        for t in buffers:
            index = order[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3])
            t[:, :, :kept] = t.gather(2, index)
    packed = torch.ones_like(keys)
    packed[:, :kept] = visible.gather(1, order)
    cache.length = kept
    return packed


@torch.no_grad()
def speculative_decode(lean, first_logits: Tensor, cache, keys: Tensor, position: Tensor,
                       prompt_ids: Tensor, prompt_mask: Tensor, request: SampleRequest,
                       speculation: Speculation) -> Completions:
    """Decode Q*G rows (question-major) with n-gram drafts verified by the policy. first_logits
    (N, V): the prefill's logits for each row's first token; cache: the lean forward's KVCache
    holding the prompts (repeated G times), of capacity at least Lp + max_new_tokens +
    speculation.num_tokens + 1; keys (N, C) bool: its visible slots; position (N, 1): each row's
    next RoPE position; prompt_ids, prompt_mask (N, Lp); request: what to draw
    (cppo.sampling.settings.SampleRequest: G, max_new_tokens, EOS, padding, the sampling
    settings, greedy, the generator, whether to record log-probs). Returns Completions with
    `speculation`."""
    n, device, k = first_logits.shape[0], first_logits.device, speculation.num_tokens
    num_generations, max_new_tokens = request.num_generations, request.max_new_tokens
    pad_token_id, greedy, generator = request.pad_token_id, request.greedy, request.generator
    sampling, eos = request.sampling, request.eos(device)
    if sampling.repetition_penalty != 1.0:
        raise ValueError("speculative sampling takes no repetition_penalty (a drafted position's "
                         "history would differ from the verified one's); set it to 1.0")
    lp = prompt_ids.shape[1]
    context, real = _contexts(prompt_ids, prompt_mask, max_new_tokens, pad_token_id)
    ids = context[:, lp:]                                   # a view: the completions
    recorded = torch.zeros(n, max_new_tokens, device=device) \
        if request.record and not greedy else None
    length = torch.zeros(n, dtype=torch.long, device=device)   # tokens generated per row
    stats = SpeculationStats()

    ids[:, 0] = tok = _first_token(first_logits, greedy, sampling, generator, recorded)
    real[:, lp], length = True, length + 1
    active = torch.arange(n, device=device)               # the row of ids each batch row fills
    finished = torch.isin(tok, eos) | (length >= max_new_tokens)   # per batch row
    while not bool(finished.all()):
        done = int(finished.sum())
        if done and 8 * done >= len(finished):             # finished rows leave the batch
            keep = (~finished).nonzero().squeeze(1)
            cache, (active, tok, finished, keys, position) = cache.select_rows(keep), (
                t[keep] for t in (active, tok, finished, keys, position))
        budget = torch.where(finished, 0, max_new_tokens - length[active] - 1)
        drafts, counts = ngram_drafts(context, real, lp + length, active, num_generations, k,
                                      budget, speculation.prompt_lookup_max,
                                      speculation.prompt_lookup_min)
        width = quorum_width(counts)
        counts, drafts = counts.clamp(max=width), drafts[:, :width]
        if cache.length + width + 1 > cache.keys[0].shape[2]:
            keys = pack_cache(cache, keys)
        base = cache.length
        block = torch.cat([tok[:, None], drafts], dim=1)                       # (m, width + 1)
        logits, _ = lean(block, position + torch.arange(width + 1, device=device), keys, cache=cache)
        logits, accepted, nxt = _verify(logits, drafts, counts, greedy, sampling, generator)
        emitted, count, ended = _emitted(drafts, accepted, nxt, finished, eos, pad_token_id)
        step = torch.arange(width + 1, device=device)
        slot = (length[active][:, None] + step[None]).clamp(max=max_new_tokens - 1)
        _write(ids, real, recorded, lp, active, slot, step[None] < count[:, None], emitted, logits)
        stats.add_forward(~finished, count, counts, accepted)
        length[active] += count
        keys[:, base:base + width + 1] = step[None] <= accepted[:, None]      # rejected: holes
        position = position + accepted[:, None] + 1
        tok = torch.where(finished, pad_token_id, nxt)
        finished = finished | ended | (length[active] >= max_new_tokens)
    out = completions_from_ids(ids[:, :int(length.max())].clone(), eos)
    if recorded is not None:
        out.logprobs = recorded[:, :out.ids.shape[1]] * out.mask
    out.speculation = stats
    return out


def _contexts(prompt_ids: Tensor, prompt_mask: Tensor, max_new_tokens: int,
              pad_token_id: int) -> tuple[Tensor, Tensor]:
    """Each row's context (N, Lp + max_new_tokens): its prompt, then room for the completion
    (pad), and which of its tokens are real (the prompt's so far)."""
    n, lp = prompt_ids.shape
    context = torch.full((n, lp + max_new_tokens), pad_token_id, dtype=torch.long,
                         device=prompt_ids.device)
    context[:, :lp] = prompt_ids
    real = torch.zeros(n, lp + max_new_tokens, dtype=torch.bool, device=prompt_ids.device)
    real[:, :lp] = prompt_mask.bool()
    return context, real


def _first_token(first_logits: Tensor, greedy: bool, sampling: SamplingSettings,
                 generator: torch.Generator | None, recorded: Tensor | None) -> Tensor:
    """The first token from the prefill's logits, as plain sampling draws it (its log-prob into
    recorded[:, 0] when recording)."""
    if greedy:
        return first_logits.argmax(-1)
    tok, logprobs = sample_logits(sampling_logits(first_logits, **sampling.kwargs()), generator,
                                  logprobs=recorded is not None)
    if recorded is not None:
        recorded[:, 0] = logprobs
    return tok


def _emitted(drafts: Tensor, accepted: Tensor, nxt: Tensor, finished: Tensor, eos: Tensor,
             pad_token_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """What each row emits after a verification: its accepted drafts then the next token
    (m, width + 1), how many of them count (up to the first EOS; 0 for a finished row) and
    whether it emitted an EOS."""
    m, width = drafts.shape
    emitted = torch.cat([drafts, drafts.new_full((m, 1), pad_token_id)], dim=1)
    emitted[torch.arange(m, device=drafts.device), accepted] = nxt
    step = torch.arange(width + 1, device=drafts.device)
    is_eos = torch.isin(emitted, eos) & (step[None] <= accepted[:, None])
    ended = is_eos.any(1)
    count = torch.where(ended, is_eos.long().argmax(1) + 1, accepted + 1)   # up to the first EOS
    return emitted, torch.where(finished, 0, count), ended


def _write(ids: Tensor, real: Tensor, recorded: Tensor | None, lp: int, active: Tensor,
           slot: Tensor, emit: Tensor, emitted: Tensor, logits: Tensor) -> None:
    """Write the emitted tokens (m, width + 1; where `emit`) into rows `active` of the
    completions at their slots, mark them real in the contexts (after the Lp prompt tokens) and,
    when recording, their log-probs under the sampled-from logits."""
    target_rows = active[:, None].expand_as(slot)
    ids[target_rows[emit], slot[emit]] = emitted[emit]
    real[target_rows[emit], lp + slot[emit]] = True
    if recorded is not None:
        logps = torch.log_softmax(logits, -1).gather(-1, emitted[..., None].clamp(min=0)).squeeze(-1)
        recorded[target_rows[emit], slot[emit]] = logps[emit]


def _verify(logits: Tensor, drafts: Tensor, counts: Tensor, greedy: bool,
            sampling: SamplingSettings, generator: torch.Generator | None
            ) -> tuple[Tensor, Tensor, Tensor]:
    """The policy's verdict on each row's drafts (m, width) from its logits (m, width + 1, V):
    the logits as sampled from (transformed unless greedy), the drafts accepted per row and the
    token after them (the policy's, or drawn from the residual distribution)."""
    m, width = drafts.shape
    rows = torch.arange(m, device=logits.device)
    if greedy:
        best = logits.argmax(-1)                                           # (m, width + 1)
        accepted = accepted_drafts_greedy(best[:, :width], drafts, counts)
        return logits, accepted, best[rows, accepted]
    logits = sampling_logits(logits.flatten(0, 1).float(), **sampling.kwargs())
    logits = logits.view(m, width + 1, -1)
    probs = logits.softmax(-1)
    draft_probs = probs[:, :width].gather(-1, drafts[..., None]).squeeze(-1)
    uniforms = torch.rand(m, width, generator=generator,
                          device=generator.device if generator is not None else logits.device
                          ).to(logits.device)
    accepted = accepted_drafts(draft_probs, counts, uniforms)
    rejected = accepted < counts
    at = drafts.gather(1, accepted.clamp(max=max(width - 1, 0))[:, None]).squeeze(1) \
        if width else torch.zeros_like(accepted)
    return logits, accepted, sample_categorical(residual_weights(probs[rows, accepted], at, rejected),
                                                generator)


@dataclass(frozen=True)
class Speculation:
    """Speculative sampling settings (vLLM's n-gram names): up to num_tokens drafts per step from
    n-grams of prompt_lookup_min..prompt_lookup_max tokens; the KV cache gets `slack` extra slots
    for rejected drafts before it is repacked."""

    num_tokens: int
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 1

    def __post_init__(self) -> None:
        if self.num_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1 to speculate, got {self.num_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")

    @property
    def slack(self) -> int:
        return 4 * (self.num_tokens + 1)
