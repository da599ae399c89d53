"""Calls reward functions with TRL's signature and checks what they return.

f(prompts, completions, completion_ids, **columns) -> list[float | None]; None means "does not
apply to this sample" and becomes NaN, ignored by the weighted sum. A function that raises,
returns the wrong number of values, or a NaN/inf/non-number is reported by name.

`preflight` runs before training: it encodes a few prompts and calls every function on them with
probe completions ("" and "0"), so a missing column, a bad gold answer or a broken function fails
with a ConfigError-compatible `RewardPreflightError` naming the row, not deep inside a step.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, NamedTuple, Sequence

import torch

from cppo.algorithm import combine_rewards
from cppo.errors import ConfigError, RewardError, RewardPreflightError, snippet

if TYPE_CHECKING:
    from cppo.config.sections import DataSection

PREFLIGHT_COMPLETIONS = ("", "0")   # an empty answer and a number: reaches gold parsing too


class Scores(NamedTuple):
    """Completions scored: rewards (Q, G), the weighted sum; per_function (N, F) (N = Q x G,
    NaN where a function does not apply); each function's mean and std; the decoded texts."""
    rewards: torch.Tensor
    per_function: torch.Tensor
    means: dict
    texts: list[str]


def check_reward_weights(weights, num_funcs: int) -> None:
    """One weight per reward function. Checked where the functions are known (the trainer, whose
    reward_funcs argument replaces the config's names), as TRL's GRPOTrainer does."""
    if weights is not None and len(weights) != num_funcs:
        raise ConfigError(f"'reward_weights' has {len(weights)} values but 'reward_funcs' has "
                          f"{num_funcs}; give one weight per function")


def reward_sources(reward_funcs, data: DataSection, env_rewards: list, processing_classes=None
                   ) -> tuple[list, list[float] | None, object]:
    """The reward functions, their weights and processing classes of a run: the trainer's
    reward_funcs (None: data.reward_funcs; none with environments that score) weighted by
    data.reward_weights, each environment class's get_reward after them with weight 1 (TRL)."""
    funcs = reward_funcs if reward_funcs is not None else ([] if env_rewards else data.reward_funcs)
    funcs = list(funcs) if isinstance(funcs, (list, tuple)) else [funcs]
    check_reward_weights(data.reward_weights, len(funcs))   # before any loading
    weights = data.reward_weights
    if env_rewards:
        extra = len(env_rewards)
        funcs = funcs + env_rewards
        weights = None if weights is None else [*weights, *[1.0] * extra]
        if isinstance(processing_classes, (list, tuple)):
            processing_classes = [*processing_classes, *[None] * extra]
    return funcs, weights, processing_classes


def is_conversational(rows: list[dict]) -> bool:
    """Rows of chat messages (TRL's conversational format): the prompt is not a string."""
    return not isinstance(rows[0]["prompt"], str)
PREFLIGHT_ENCODED_ROWS = 8          # prompts tokenised by preflight (all rows are of one kind)


def unpadded_ids(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    """Padded completion ids (N, T) and their mask (N, T) -> N lists of the real tokens (up to and
    including EOS), what TRL hands reward functions as `completion_ids`."""
    return [[token for token, real in zip(row, keep) if real]   # plain lists: one call per tensor
            for row, keep in zip(ids.tolist(), mask.bool().tolist())]


class RewardRunner:
    def __init__(self, funcs: Sequence[str | Callable], weights: Sequence[float] | None = None,
                 processing_classes=None, device=None, trust_remote_code: bool = False):
        """trust_remote_code: for reward models loaded by name (and their tokenizers), as TRL."""
        from cppo.rewards import resolve_reward
        from cppo.rewards.reward_model import RewardModel
        if not funcs:
            raise ValueError("reward_funcs is empty; give at least one reward function")
        classes = list(processing_classes) if isinstance(processing_classes, (list, tuple)) \
            else [processing_classes] * len(funcs)   # TRL: one, or one per reward function
        if len(classes) != len(funcs):
            raise ConfigError(f"{len(classes)} reward_processing_classes for {len(funcs)} "
                              f"reward functions; give one per function (None for functions)")
        try:
            self.funcs = [resolve_reward(f, pc, device, trust_remote_code)
                          for f, pc in zip(funcs, classes)]
        except (ValueError, TypeError) as err:   # unknown name, module not importable, ...
            raise ConfigError(f"reward_funcs: {err}") from err
        self.names = [getattr(fn, "__name__", str(fn)) if isinstance(fn, RewardModel)
                      or not (isinstance(f, str) and ":" not in f) else f
                      for f, fn in zip(funcs, self.funcs)]
        for name, fn in zip(self.names, self.funcs):
            if not callable(fn):
                raise ValueError(f"reward function '{name}' is not callable")
        check_reward_weights(weights, len(self.funcs))
        self.weights = torch.tensor(weights if weights is not None else [1.0] * len(self.funcs))

    def close(self) -> None:
        """Stop the worker processes rewards started in this process (math-verify's pool)."""
        from cppo.rewards import math_rewards
        math_rewards.close_default_verifier()

    def __call__(self, rows: list[dict], texts: list[str], completion_ids: list[list[int]] | None,
                 num_generations: int, conversational: bool = False,
                 extra_columns: dict[str, list] | None = None,
                 messages: list[list[dict]] | None = None) -> torch.Tensor:
        """Rewards (N, F), N = len(rows) * num_generations, NaN where a function returned None.

        completion_ids: one unpadded token-id list per completion (TRL's convention; see
        `unpadded_ids`), or None (empty lists are passed). extra_columns: more reward columns,
        one value per completion (a rollout function's extra keys). messages: each conversational
        completion as its chat messages (a tool loop's turns and tool results; TRL's form)."""
        n = len(rows) * num_generations
        if len(texts) != n:
            raise ValueError(f"{len(texts)} completions for {len(rows)} questions x {num_generations}")
        prompts = [r["prompt"] for r in rows for _ in range(num_generations)]
        columns = {k: [r[k] for r in rows for _ in range(num_generations)]
                   for k in rows[0] if k not in ("prompt", "completion", "completion_ids")}
        columns.update(extra_columns or {})   # a rollout function's own (one value per completion)
        completions = ([[{"role": "assistant", "content": t}] for t in texts]
                       if conversational else list(texts))
        if conversational and messages is not None and len(messages) == n:
            completions = messages
        if torch.is_tensor(completion_ids):
            raise TypeError("completion_ids must be unpadded lists of token ids (TRL); turn a "
                            "padded (N, T) tensor into them with unpadded_ids(ids, mask)")
        ids = [list(c) for c in completion_ids] if completion_ids is not None else [[] for _ in texts]
        if len(ids) != n:
            raise ValueError(f"{len(ids)} completion_ids lists for {n} completions")
        out = torch.empty(n, len(self.funcs))
        for j, (name, fn) in enumerate(zip(self.names, self.funcs)):
            try:
                values = fn(prompts=prompts, completions=completions, completion_ids=ids, **columns)
            except Exception as err:  # noqa: BLE001 -- re-raised with the function's name
                raise RewardError(f"reward function '{name}' raised {type(err).__name__}: {err}") from err
            out[:, j] = self._check(name, values, n)
        return out

    @staticmethod
    def _check(name: str, values, n: int) -> torch.Tensor:
        if not isinstance(values, (list, tuple)) and not torch.is_tensor(values):
            raise RewardError(f"reward function '{name}' returned {type(values).__name__}; "
                              f"expected a list of {n} floats (or None)")
        values = list(values.tolist() if torch.is_tensor(values) else values)
        if len(values) != n:
            raise RewardError(f"reward function '{name}' returned {len(values)} values for {n} "
                              f"completions")
        clean = []
        for i, v in enumerate(values):
            if v is None:
                clean.append(math.nan)
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise RewardError(f"reward function '{name}' returned {v!r} for completion {i}; "
                                  f"expected a float or None")
            if not math.isfinite(v):
                raise RewardError(f"reward function '{name}' returned {v} for completion {i}; "
                                  f"rewards must be finite (use None for 'does not apply')")
            clean.append(float(v))
        return torch.tensor(clean)

    def means(self, per_function: torch.Tensor) -> dict[str, float]:
        """TRL's rewards/<name>/mean and /std (unbiased; NaN-aware) for each function."""
        out = {}
        for j, name in enumerate(self.names):
            col = per_function[:, j]
            col = col[~torch.isnan(col)]
            out[f"rewards/{name}/mean"] = float(col.mean()) if col.numel() else math.nan
            out[f"rewards/{name}/std"] = float(col.std()) if col.numel() > 1 else math.nan
        return out

    def score(self, tokenizer, rows: list[dict], completions, group: int,
              extra_columns: dict[str, list] | None = None,
              messages: list[list[dict]] | None = None) -> Scores:
        """Decode, score and combine `completions` (len(rows) x group rows, question-major):
        one place for training and evaluation."""
        texts = tokenizer.batch_decode(completions.ids.cpu(), skip_special_tokens=True)
        per_function = self(rows, texts, unpadded_ids(completions.ids, completions.mask), group,
                            conversational=is_conversational(rows), extra_columns=extra_columns,
                            messages=messages)
        rewards = combine_rewards(per_function, self.weights).view(len(rows), group)
        return Scores(rewards, per_function, self.means(per_function), texts)

    def preflight(self, rows: list[dict], tokenizer=None) -> None:
        """Before training: encode the first rows' prompts (when a tokenizer is given) and call
        every function on each row with the probe completions; raise naming the first failing
        row. Cost: one reward call per function over len(rows) x 2 probe completions."""
        if not rows:
            return
        conversational = is_conversational(rows)
        if tokenizer is not None:
            from cppo.sampling.sampler import encode_prompts
            for i, row in enumerate(rows[:PREFLIGHT_ENCODED_ROWS]):  # check_rows made them one kind
                try:
                    encode_prompts(tokenizer, [row["prompt"]])
                except ValueError as err:
                    raise RewardPreflightError(f"row {i}: its prompt cannot be encoded: {err}") from err
        probes = list(PREFLIGHT_COMPLETIONS)
        try:
            self(rows, probes * len(rows), None, len(probes), conversational=conversational)
        except RewardError as err:
            for i, row in enumerate(rows):   # name the first row that fails on its own
                try:
                    self([row], probes, None, len(probes), conversational=conversational)
                except RewardError as row_err:
                    raise RewardPreflightError(f"before training, on row {i} "
                                               f"({snippet(row)}): {row_err}") from row_err
            raise RewardPreflightError(f"before training: {err}") from err
