"""Completions that are not one sampled turn: TRL's `rollout_func` and its `env_mask`.

A rollout function takes the step's prompts (each question's prompt num_generations times, as
TRL's GRPOTrainer hands them) and the trainer, and returns, one entry per prompt, the prompt's
token ids, the completion's token ids (every turn: the model's tokens and what tools or an
environment put between them) and the sampler's log-prob of each completion token (or None).
An optional `env_mask` (1: a model token, 0: a token the environment wrote) keeps the
environment's tokens in the context of every forward pass but out of the loss. Any other key is
a column handed to the reward functions (one value per completion).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from cppo.errors import RolloutError
from cppo.sampling.batches import Completions, PromptBatch
from cppo.sampling.padding import pad_token_lists

REQUIRED_KEYS = ("prompt_ids", "completion_ids", "logprobs")


@dataclass
class Rollout:
    """One step's rollouts: prompts (N rows, one per completion), completions (N) with their
    tool_mask (N, T) when the environment wrote tokens, and the extra reward columns."""

    prompts: PromptBatch
    completions: Completions
    columns: dict[str, list]


def _token_lists(name: str, value, n: int) -> list[list[int]]:
    if not isinstance(value, (list, tuple)) or len(value) != n:
        size = len(value) if isinstance(value, (list, tuple)) else type(value).__name__
        raise RolloutError(f"rollout_func returned '{name}' with {size} entries for {n} prompts; "
                           f"expected one list of token ids per prompt")
    out = []
    for i, ids in enumerate(value):
        ids = ids.tolist() if torch.is_tensor(ids) else ids
        if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) for t in ids):
            raise RolloutError(f"rollout_func returned '{name}'[{i}] = {ids!r:.80}; expected a list "
                               f"of token ids (ints)")
        out.append(list(ids))
    return out


def rollout_from_output(output: Any, num_rows: int, *, eos_token_id: int | Sequence[int],
                        pad_token_id: int, device=None) -> Rollout:
    """Check a rollout function's output (the dict TRL's rollout_func returns) for num_rows
    prompts and turn it into padded prompts and completions.

    A completion is truncated when its last token is neither EOS nor padding (TRL's rule); its
    mask is 1 on every token it has (TRL keeps all of a multi-turn completion's tokens)."""
    if not isinstance(output, dict):
        raise RolloutError(f"rollout_func returned {type(output).__name__}; expected a dict with "
                           f"keys {list(REQUIRED_KEYS)}")
    missing = [k for k in REQUIRED_KEYS if k not in output]
    if missing:
        raise RolloutError(f"rollout_func must return keys {missing} in its output dict "
                           f"(it returned {sorted(output)})")
    prompt_ids = _token_lists("prompt_ids", output["prompt_ids"], num_rows)
    completion_ids = _token_lists("completion_ids", output["completion_ids"], num_rows)
    if any(not ids for ids in prompt_ids):
        raise RolloutError("rollout_func returned an empty prompt; every prompt needs a token")
    ids, mask = pad_token_lists(completion_ids, pad_token_id, side="right", min_width=1)
    width = ids.shape[1]
    eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
    truncated = torch.tensor([not c or c[-1] not in eos | {pad_token_id} for c in completion_ids])
    logprobs = None
    if output["logprobs"] is not None:
        rows = output["logprobs"]
        if not isinstance(rows, (list, tuple)) or len(rows) != num_rows or any(
                len(lp) != len(c) for lp, c in zip(rows, completion_ids)):
            raise RolloutError("rollout_func returned 'logprobs' that do not match "
                               "'completion_ids' (one log-prob per completion token, or None)")
        logprobs = torch.stack([F.pad(torch.tensor([float("nan") if v is None else float(v)
                                                    for v in lp], dtype=torch.float32),
                                      (0, width - len(lp))) for lp in rows])
        logprobs = torch.nan_to_num(logprobs, nan=0.0)
    tool_mask = None
    extra = {k: v for k, v in output.items() if k not in REQUIRED_KEYS}
    env_mask = extra.pop("env_mask", None)
    extra.pop("logprob_token_ids", None)
    if env_mask is not None:
        rows = _token_lists("env_mask", env_mask, num_rows)
        if any(len(m) != len(c) or set(m) - {0, 1} for m, c in zip(rows, completion_ids)):
            raise RolloutError("rollout_func returned an 'env_mask' that does not match "
                               "'completion_ids' (one 0 or 1 per completion token)")
        tool_mask = torch.stack([F.pad(torch.tensor(m, dtype=torch.long), (0, width - len(m)),
                                       value=1) for m in rows])
    for key, values in extra.items():
        if not isinstance(values, (list, tuple)) or len(values) != num_rows:
            raise RolloutError(f"rollout_func returned '{key}' that is not a list of {num_rows} "
                               f"values (an extra key is a reward column: one value per prompt)")
    completions = Completions(ids.to(device), mask.to(device), truncated.to(device),
                              None if logprobs is None else logprobs.to(device),
                              tool_mask=None if tool_mask is None else tool_mask.to(device),
                              columns={k: list(v) for k, v in extra.items()})
    prompts = PromptBatch(*pad_token_lists(prompt_ids, pad_token_id, side="left"))
    return Rollout(prompts.to(device), completions, completions.columns)
