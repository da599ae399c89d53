"""A round's generation stage: the G completions of each question through the generation
backend (cppo.sampling.backends), or a rollout function's rollouts (two_stage_generations' two
stages: cppo.features.two_stage). Each returns its values; nothing is kept between rounds."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from cppo.sampling.batches import Completions, PromptBatch
from cppo.sampling.multi_turn import rollout_from_output
from cppo.sampling.sampler import encode_prompts
from cppo.sampling.tools import ToolLoop


@dataclass(frozen=True)
class Generation:
    """What generation uses, set once per run: the backend, the tokenizer, the engine (its
    `gathered()` hands the sampler the full weights under fsdp, once per round), the device,
    this process's rank, the config's num_generations (G), max_prompt_length and seed."""

    backend: object
    tokenizer: object
    engine: object
    device: torch.device
    rank: int
    num_generations: int
    max_prompt_length: int | None
    seed: int

    def prompts(self, rows: list[dict]) -> PromptBatch:
        """The rows' prompts, encoded (left-padded) on the device."""
        return encode_prompts(self.tokenizer, [r["prompt"] for r in rows],
                              self.max_prompt_length).to(self.device)

    def sample(self, rows: list[dict], round_index: int, start: int = 0,
               stop: int | None = None) -> tuple[PromptBatch, Completions]:
        """G completions per row, seeded by (seed, round, the rows' place in the global batch).
        start:stop: only those rows (a generator process's share: whole generation chunks), as
        the whole batch samples them: padded as all `rows`, seeded by their own place."""
        prompts = self.prompts(rows)
        if (start, stop) != (0, None):
            prompts = prompts.select(slice(start, stop))
        with self.engine.gathered():      # fsdp: full weights once per round, not per token
            completions = self.backend.generate(prompts, round_index=round_index,
                                                question_offset=self.rank * len(rows) + start)
        return prompts, completions

    def rollout(self, rollout_func, rows: list[dict], round_index: int,
                caller) -> tuple[PromptBatch, Completions]:
        """TRL's rollout_func: called with each row's prompt G times (a copy) and `caller` (the
        trainer, as TRL passes it; cppo's tool loop gets its ToolContext); its output checked and
        padded (cppo.sampling.multi_turn), one prompt row per completion, the extra reward
        columns on the completions."""
        g = self.num_generations
        prompts = [copy.deepcopy(r["prompt"]) for r in rows for _ in range(g)]
        with self.engine.gathered():      # fsdp: the full weights, for the push and the sampling
            if prompts:   # vLLM: this round's weights
                probe = encode_prompts(self.tokenizer, prompts[:1], self.max_prompt_length)
                self.backend.sync_weights(round_index, probe=probe.ids[0].tolist())
            if isinstance(rollout_func, ToolLoop):   # environments are reset with the rows
                output = rollout_func(prompts, caller, rows=[r for r in rows for _ in range(g)])
            else:
                output = rollout_func(prompts, caller)
        self.backend.rest()    # as after the backend's own generation (sleep mode)
        out = rollout_from_output(output, len(prompts), eos_token_id=self.tokenizer.eos_token_id,
                                  pad_token_id=self.tokenizer.pad_token_id, device=self.device)
        return out.prompts, out.completions
