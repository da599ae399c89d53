"""The kept completions of one step, as the forward passes take them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass
class StepBatch:
    """The kept completions of one step, ready for the forward passes (K kept rows)."""

    prompt_ids: torch.Tensor       # (K, Lp)
    prompt_mask: torch.Tensor      # (K, Lp)
    completion_ids: torch.Tensor   # (K, T)
    completion_mask: torch.Tensor  # (K, T) loss mask (truncated ones zeroed if asked)
    advantages: torch.Tensor       # (K,)
    old_logps: torch.Tensor | None = None  # (K, T), only when a round has several steps
    ref_logps: torch.Tensor | None = None  # (K, T), only when beta > 0
    sampler_logps: torch.Tensor | None = None  # (K, T), when the sampler is not the policy
    filler_rows: int = 0   # trailing rows that only align collectives across processes (no loss)
    tool_mask: torch.Tensor | None = None  # (K, T) multi-turn: 0 on tokens a tool wrote

    # what a filler row holds: prompt attended (so attention has a key), nothing to learn
    FILL = {"prompt_mask": 1, "tool_mask": 1}
    PROMPT = ("prompt_ids", "prompt_mask")   # (K, Lp); the other (K, T) tensors are per token

    @property
    def loss_mask(self) -> torch.Tensor:
        """(K, T) the tokens the loss trains: completion_mask (which the forward passes attend
        to), less the tokens a tool or environment wrote (TRL: completion_mask * tool_mask)."""
        return self.completion_mask if self.tool_mask is None else self.completion_mask * self.tool_mask

    def __len__(self) -> int:
        return self.completion_ids.shape[0]

    def tensors(self) -> dict[str, torch.Tensor | None]:
        """Every tensor field by name (None where absent)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "filler_rows"}

    def _map(self, fn, **changes) -> "StepBatch":
        return dataclasses.replace(self, **{name: None if t is None else fn(name, t)
                                            for name, t in self.tensors().items()}, **changes)

    def micro_batches(self, size: int):
        """Consecutive slices of `size` rows, each trimmed to its own longest completion."""
        for s in range(0, len(self), size):
            yield self._map(lambda _, t: t[s:s + size], filler_rows=0).trimmed()

    def split(self, parts: int) -> list["StepBatch"]:
        """`parts` consecutive slices of (nearly) equal rows, each trimmed: a generation round's
        batch as the optimizer steps take it (TRL's split into steps_per_generation slices).
        Filler rows (trailing) stay counted in the slices that hold them."""
        bounds = [len(self) * i // parts for i in range(parts + 1)]
        real = len(self) - self.filler_rows
        return [dataclasses.replace(self._map(lambda _, t: t[a:b]).trimmed(),
                                    filler_rows=max(0, b - max(a, real)))
                for a, b in zip(bounds, bounds[1:])]

    def trimmed(self) -> "StepBatch":
        """The same rows without the columns no row uses: prompt columns left of the longest
        prompt, completion columns right of the longest completion (by completion_mask). Padding
        is masked out of attention and loss, so every pass gives the same values on fewer tokens."""
        if len(self) == 0:
            return self
        used = self.prompt_mask.any(0).nonzero()
        start = int(used[0]) if len(used) else self.prompt_ids.shape[1] - 1
        width = max(1, int(self.completion_mask.sum(1).max()))
        return self._map(lambda name, t: t if t.dim() == 1 else
                         t[:, start:] if name in self.PROMPT else t[:, :width], filler_rows=0)

    def with_filler_rows(self, extra: int) -> "StepBatch":
        """`extra` filler rows appended (prompt attended, completion mask 0, advantage 0)."""
        if extra == 0:
            return self

        def grow(name, t):
            fill = self.FILL.get(name, 0)
            shape = (extra, *t.shape[1:]) if t.dim() > 1 else (extra,)
            if t.dim() > 1 and t.shape[1] == 0:
                shape = (extra, 1, *t.shape[2:])
                t = t.new_full((0, 1, *t.shape[2:]), fill)
            return torch.cat([t, t.new_full(shape, fill)])
        return self._map(grow, filler_rows=self.filler_rows + extra)


def trained_mask(completions, *, mask_truncated: bool) -> torch.Tensor:
    """(N, T) the completion mask, none on a completion without EOS when mask_truncated."""
    if not mask_truncated:
        return completions.mask
    return completions.mask * (~completions.truncated).long()[:, None]


def loss_token_counts(completions, *, mask_truncated: bool) -> torch.Tensor:
    """(N,) each completion's tokens in the loss, as `kept_batch`'s batch counts them (its
    loss_mask: the trained mask less the tokens a tool wrote)."""
    mask = trained_mask(completions, mask_truncated=mask_truncated)
    if completions.tool_mask is not None:
        mask = mask * completions.tool_mask
    return mask.sum(1)


def kept_batch(prompts, completions, advantages: torch.Tensor, keep_mask: torch.Tensor, *,
               num_generations: int, mask_truncated: bool, sampler_logprobs: bool) -> StepBatch:
    """The kept completions (keep_mask (Q, G)) with their prompts (one row per question, or per
    completion for rollouts), loss masks (mask_truncated: none on a completion without EOS),
    advantages (Q, G) and, with sampler_logprobs, the sampler's log-probs; trimmed, so no pass
    runs on pruned widths."""
    kept = keep_mask.flatten().nonzero().squeeze(1).to(completions.ids.device)  # of Q*G rows
    question = kept if len(prompts) == len(completions.ids) else kept // num_generations
    mask = trained_mask(completions, mask_truncated=mask_truncated)[kept]
    sampler_logps = None
    if completions.logprobs is not None and sampler_logprobs:
        sampler_logps = completions.logprobs[kept].float()
    tool_mask = None if completions.tool_mask is None else completions.tool_mask[kept]
    return StepBatch(prompts.ids[question], prompts.mask[question], completions.ids[kept],
                     mask, advantages.flatten().to(kept.device)[kept].float(),
                     sampler_logps=sampler_logps, tool_mask=tool_mask).trimmed()
