"""The selection stage of a round: which completions go on to the forward passes, and the
advantages the loss takes for them (cppo.algorithm.selection's rules on this process's values,
with the other processes' where the scope is global)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cppo.algorithm.allocation import StepShape
from cppo.algorithm.loss import TOKEN_NORMALISED_LOSSES
from cppo.algorithm.selection import (GLOBAL_SCOPE, round_inclusion_weights, round_keep_mask,
                                      rule_traits)
from cppo.algorithm.two_stage import completions_to_keep
from cppo.run.batch import loss_token_counts
from cppo.sampling.batches import Completions
from cppo.sampling.sampler import chunk_seed


@dataclass(frozen=True)
class Selector:
    """selection_rule and selection_scope over the round's (Q, G) groups, keeping the plan's
    count (or auto's rate); `dist`: the processes (cppo.parallel.processes.Distributed)."""

    rule: str
    scope: str
    pruning_rate: float | str
    plan: StepShape
    num_generations: int
    seed: int
    loss_type: str
    mask_truncated: bool
    dist: object

    @property
    def advantages_on_kept(self) -> bool:
        """The rule recomputes advantages over the kept completions (question scope)."""
        return rule_traits(self.rule).advantages_on_kept

    def keep_mask(self, advantages: torch.Tensor, rewards: torch.Tensor, round_index: int,
                  auto_rate: float | None = None) -> torch.Tensor:
        """(Q, G) bool: the kept completions. A random rule draws from a generator seeded per
        round: the same on all processes for the global scope (they must agree), per process
        otherwise. auto_rate: pruning_rate auto's rate for this round."""
        if self.pruning_rate == 0:
            return torch.ones_like(advantages, dtype=torch.bool)
        dist = self.dist
        key = -1 if self.scope == GLOBAL_SCOPE else -1 - dist.rank
        return round_keep_mask(
            advantages, rewards, rule=self.rule, scope=self.scope,
            num_keep=completions_to_keep(self.plan, advantages.shape[0], self.num_generations,
                                         auto_rate),
            generator=torch.Generator().manual_seed(chunk_seed(self.seed, round_index, key)),
            rank=dist.rank, world_size=dist.world_size, gather=dist.gather)

    def loss_advantages(self, advantages: torch.Tensor, keep_mask: torch.Tensor,
                        completions: Completions) -> torch.Tensor:
        """(Q, G) the advantages the loss takes: as they are, or, for a rule that reweights
        (selection_rule unbiased), times its inclusion weights (cppo.algorithm.inclusion) over the
        design `keep_mask` drew from (num_keep: this process's kept count; the global scope's,
        every process's over world_size), with the loss normaliser's kept share over every
        process: of the loss tokens for token-normalised losses, of the completions otherwise."""
        if not rule_traits(self.rule).reweights:
            return advantages
        dist = self.dist
        kept, world = int(keep_mask.sum()), dist.world_size
        num_keep = int(dist.sum(kept)) // world if self.scope == GLOBAL_SCOPE else kept
        share = None
        if self.loss_type in TOKEN_NORMALISED_LOSSES:
            tokens = loss_token_counts(completions, mask_truncated=self.mask_truncated)
            tokens = tokens.view(keep_mask.shape).to(keep_mask.device)
            total = dist.sum_values({"kept": float(tokens[keep_mask].sum()),
                                     "all": float(tokens.sum())})
            share = total["kept"] / max(total["all"], 1.0)
        weights = round_inclusion_weights(advantages, num_keep=num_keep, scope=self.scope,
                                          kept_share=share, rank=dist.rank, world_size=world,
                                          gather=dist.gather)
        return advantages * weights.to(advantages.device, advantages.dtype)
