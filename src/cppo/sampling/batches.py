"""What the samplers return: prompts as a padded batch, completions with their masks, flags and
sampler log-probs."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from cppo.sampling.padding import pad_token_lists


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
class DecodeStats:
    """Counts over a generation's decode steps (after the prefill): `rows`, the completions that
    went on to another token, summed over the steps; `sequences`, the rows the forwards ran:
    fewer where completions identical so far shared one sequence (share_prefixes), a few more
    where finished completions had not yet left the batch."""

    rows: int = 0
    sequences: int = 0

    def __add__(self, other: "DecodeStats") -> "DecodeStats":
        return DecodeStats(self.rows + other.rows, self.sequences + other.sequences)

    def metrics(self) -> dict:
        return {"cppo/decode_rows_saved": 1 - self.sequences / self.rows if self.rows else 0.0}


@dataclass
class Completions:
    """Sampled completions, question-major: row q*G + g is completion g of question q.

    ids (N, T) padded after EOS; mask (N, T) 1 on tokens up to and including EOS;
    truncated (N,) True where no EOS was produced within the length limit; logprobs (N, T), when
    the sampler recorded them: log-probability of each token under the distribution it was drawn
    from (after temperature, top-k, top-p; 0 after EOS); speculation: the speculative sampler's
    counts (cppo.sampling.speculative.SpeculationStats) when it ran; tool_mask (N, T), for
    multi-turn completions (cppo.sampling.multi_turn): 0 on the tokens a tool or environment wrote
    (in the context, out of the loss), 1 elsewhere; decode: the built-in sampler's DecodeStats
    when it shared prefixes; columns: a rollout function's extra reward columns (one value per
    completion), None for sampled completions."""

    ids: Tensor
    mask: Tensor
    truncated: Tensor
    logprobs: Tensor | None = None
    speculation: object | None = None
    tool_mask: Tensor | None = None
    decode: DecodeStats | None = None
    columns: dict[str, list] | None = None

    @property
    def lengths(self) -> Tensor:
        return self.mask.sum(-1)

    def to(self, device) -> "Completions":
        """The same completions with every tensor on `device`."""
        return dataclasses.replace(self, **{
            f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), Tensor)})


def concat_completions(parts: list[Completions], pad_token_id: int) -> Completions:
    """Stack completion batches of different lengths (right-padded to the longest)."""
    if len(parts) == 1:
        return parts[0]
    width = max(p.ids.shape[1] for p in parts)
    logprobs = None
    if all(p.logprobs is not None for p in parts):
        logprobs = torch.cat([F.pad(p.logprobs, (0, width - p.logprobs.shape[1])) for p in parts])
    speculation = _summed([p.speculation for p in parts])
    return Completions(
        ids=torch.cat([F.pad(p.ids, (0, width - p.ids.shape[1]), value=pad_token_id) for p in parts]),
        mask=torch.cat([F.pad(p.mask, (0, width - p.mask.shape[1])) for p in parts]),
        truncated=torch.cat([p.truncated for p in parts]), logprobs=logprobs, speculation=speculation,
        decode=_summed([p.decode for p in parts]))


def _summed(stats: list):
    """The sum of per-part statistics (SpeculationStats, DecodeStats); None if any part has none."""
    if not stats or any(s is None for s in stats):
        return None
    return functools.reduce(lambda a, b: a + b, stats)


def group_rows(questions: Tensor, group_size: int) -> Tensor:
    """Row indices (K * group_size,) of the groups of `questions` (K,) in a question-major batch."""
    return (questions[:, None] * group_size + torch.arange(group_size, device=questions.device)).flatten()


def merge_groups(first: Completions, k: int, rows: Tensor, second: Completions,
                 pad_token_id: int) -> Completions:
    """The first-stage groups (k completions per question, question-major) of the questions
    `rows` (K,), each followed by that question's completions in `second` (K groups of G - k):
    K question-major groups of G, the first-stage completions reused as they are."""
    num, rest = len(rows), second.ids.shape[0] // max(1, len(rows))
    picked = group_rows(rows.to(first.ids.device), k)
    width = max(first.ids.shape[1], second.ids.shape[1])

    def join(a: Tensor | None, b: Tensor | None, value=0) -> Tensor | None:
        if a is None or b is None:
            return None
        a = a[picked]
        if a.dim() == 2:
            a, b = (F.pad(t, (0, width - t.shape[1]), value=value) for t in (a, b))
        a, b = a.view(num, k, *a.shape[1:]), b.view(num, rest, *b.shape[1:])
        return torch.cat([a, b.to(a.device)], dim=1).flatten(0, 1)

    return Completions(ids=join(first.ids, second.ids, pad_token_id), mask=join(first.mask, second.mask),
                       truncated=join(first.truncated, second.truncated),
                       logprobs=join(first.logprobs, second.logprobs),
                       speculation=_summed([first.speculation, second.speculation]),
                       tool_mask=join(first.tool_mask, second.tool_mask, 1),
                       decode=_summed([first.decode, second.decode]))


def completions_from_ids(ids: Tensor, eos: Tensor) -> Completions:
    """Completions from sampled tokens (N, T) padded after EOS; mask 1 up to and including the first EOS."""
    is_eos = torch.isin(ids, eos)
    after_eos = (is_eos.cumsum(1) - is_eos.long()) > 0
    return Completions(ids=ids, mask=(~after_eos).long(), truncated=~is_eos.any(1))


def completions_from_token_lists(token_lists: list[list[int]], eos_token_id, pad_token_id: int,
                                 max_new_tokens: int, device=None) -> Completions:
    """Completions from per-completion token id lists (what vLLM returns)."""
    eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
    kept, truncated = [], []
    for tokens in token_lists:        # up to and including the first EOS, at most max_new_tokens
        end = next((i + 1 for i, t in enumerate(tokens) if t in eos), None)
        kept.append(list(tokens[:min(end or max_new_tokens, max_new_tokens)]))
        truncated.append(end is None or end > max_new_tokens)
    ids, mask = pad_token_lists(kept, pad_token_id, side="right", min_width=1)
    truncated = torch.tensor(truncated, dtype=torch.bool)
    return Completions(ids.to(device), mask.to(device), truncated.to(device))
