"""Which completions to keep (completion pruning), decided from rewards and advantages only.

All tensors are (Q, G): Q questions x G completions each. The result is a bool keep_mask with
exactly `num_keep` True entries. Scope:
  'question': every question keeps num_keep // Q completions (num_keep must be divisible by Q);
  'step':     one selection over all Q * G completions of the step (a question keeps 0..G),
              as in the CPPO authors' code.

Rules (registry SELECTION_RULES; add one with `@register_rule("name")`; what a rule needs from
the trainer, its scopes and whether advantages are recomputed on the kept completions, is in
RULE_TRAITS):
  largest_abs   CPPO default: keep the largest |A| (they carry the most policy gradient).
  smallest_abs  ablation: keep the smallest |A|.
  random        ablation: uniformly random, reproducible with a seeded torch.Generator.
  max_variance  PODS (Xu et al., 2025): per question keep the subset with maximum reward
                variance; 'question' scope only. Advantages are then recomputed on the kept
                subset with `recompute_advantages_on_kept` (traits advantages_on_kept=True).
  unbiased      draw num_keep completions with probabilities pi ~ |A| + 0.1 mean|A| (capped
                at 1; systematic sampling, seeded generator) and weight each kept advantage by
                kept share / pi (traits reweights=True; `round_inclusion_weights`), so the
                policy term's gradient is unbiased for the unpruned one (cppo.algorithm.inclusion).

Tie-breaking (deterministic, never torch.topk): score-based rules sort with a stable sort, so
among exactly equal scores the lower flat index wins -- question-major, then completion index
(for 'question' scope: the lower completion index). max_variance sorts each question's rewards
ascending with a stable sort (equal rewards: lower completion index first), keeps the first
m - i and the last i entries of that order (so among equal high rewards the higher index is
kept), and takes the smallest i among equal variances. Scores compare by exact float equality.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from torch import Tensor

from cppo.algorithm.inclusion import inclusion_weights, keep_by_inclusion

SCOPES = ("question", "step")
GLOBAL_SCOPE = "global"   # the step scope, ranked over every process's completions
SELECTION_SCOPES = (*SCOPES, GLOBAL_SCOPE)


def local_scope(scope: str) -> str:
    """The scope one process ranks and plans with: the global scope is the step scope (on one
    process, and for the per-process shape of a step)."""
    return "step" if scope == GLOBAL_SCOPE else scope


class SelectionRule(Protocol):
    def __call__(
        self,
        advantages: Tensor,
        rewards: Tensor,
        *,
        num_keep: int,
        scope: str,
        generator: torch.Generator | None,
    ) -> Tensor: ...


@dataclass(frozen=True)
class RuleTraits:
    """What a selection rule asks of its caller.

    scopes: the scopes it can rank in. advantages_on_kept: the advantages used for the loss are
    recomputed within each question's kept completions (`recompute_advantages_on_kept`).
    reweights: the kept advantages are multiplied by the rule's inclusion weights
    (`round_inclusion_weights`) before the loss.
    """

    scopes: tuple[str, ...] = SCOPES
    advantages_on_kept: bool = False
    reweights: bool = False


SELECTION_RULES: dict[str, SelectionRule] = {}
RULE_TRAITS: dict[str, RuleTraits] = {}


def register_rule(
    name: str, *, scopes: tuple[str, ...] = SCOPES, advantages_on_kept: bool = False,
    reweights: bool = False,
) -> Callable[[SelectionRule], SelectionRule]:
    """Decorator adding a rule to SELECTION_RULES (and its traits to RULE_TRAITS) under `name`.

    A rule takes (advantages, rewards, *, num_keep, scope, generator), all (Q, G) tensors,
    arguments already validated, and returns a bool keep_mask (Q, G) with num_keep True.
    """
    unknown = [s for s in scopes if s not in SCOPES]
    if unknown or not scopes:
        raise ValueError(f"rule {name!r}: scopes must be a non-empty subset of {SCOPES}, got {scopes!r}")

    def add(rule: SelectionRule) -> SelectionRule:
        if name in SELECTION_RULES:
            raise ValueError(f"selection rule {name!r} is already registered")
        SELECTION_RULES[name] = rule
        RULE_TRAITS[name] = RuleTraits(tuple(scopes), advantages_on_kept, reweights)
        return rule

    return add


def rule_traits(name: str) -> RuleTraits:
    """The traits of a registered rule (defaults for one put into SELECTION_RULES by hand)."""
    if name not in SELECTION_RULES:
        raise ValueError(f"unknown selection rule {name!r}; registered rules: {sorted(SELECTION_RULES)}")
    return RULE_TRAITS.get(name, RuleTraits())


def keep_highest_scores(scores: Tensor, *, num_keep: int, scope: str) -> Tensor:
    """keep_mask (Q, G) of the num_keep highest scores (per question or over the step).

    Ties: stable descending sort, so the lower (flat) index wins among equal scores.
    """
    num_questions, group_size = scores.shape
    if scope == "question":
        keep_per_question = num_keep // max(num_questions, 1)
        order = torch.sort(scores, dim=1, descending=True, stable=True).indices
        keep_mask = torch.zeros_like(scores, dtype=torch.bool)
        keep_mask.scatter_(1, order[:, :keep_per_question], True)
        return keep_mask
    order = torch.sort(scores.flatten(), descending=True, stable=True).indices
    keep_mask = torch.zeros(scores.numel(), dtype=torch.bool, device=scores.device)
    keep_mask[order[:num_keep]] = True
    return keep_mask.view(num_questions, group_size)


def keep_largest_abs_advantage(advantages, rewards, *, num_keep, scope, generator):
    """CPPO: keep the completions with the largest |A|; all-equal groups (A = 0) go first."""
    return keep_highest_scores(advantages.abs(), num_keep=num_keep, scope=scope)


def keep_smallest_abs_advantage(advantages, rewards, *, num_keep, scope, generator):
    """Ablation: keep the completions with the smallest |A|."""
    return keep_highest_scores(-advantages.abs(), num_keep=num_keep, scope=scope)


def keep_random(advantages, rewards, *, num_keep, scope, generator):
    """Ablation: keep a uniformly random subset (reproducible with a seeded generator)."""
    device = generator.device if generator is not None else advantages.device
    scores = torch.rand(advantages.shape, generator=generator, device=device)
    return keep_highest_scores(scores.to(advantages.device), num_keep=num_keep, scope=scope)


def keep_max_reward_variance(advantages, rewards, *, num_keep, scope, generator):
    """PODS: per question keep the m rewards of maximum variance = the i highest + m - i lowest.

    The best i in 0..m is found by scanning; equal variances keep the smallest i.
    """
    num_questions, group_size = rewards.shape
    keep_per_question = num_keep // max(num_questions, 1)
    if keep_per_question == 0:
        return torch.zeros_like(rewards, dtype=torch.bool)
    ascending = torch.sort(rewards, dim=1, stable=True).indices  # (Q, G)
    sorted_rewards = rewards.gather(1, ascending).double()
    variances = []
    for num_highest in range(keep_per_question + 1):
        num_lowest = keep_per_question - num_highest
        subset = torch.cat(
            [sorted_rewards[:, :num_lowest], sorted_rewards[:, group_size - num_highest :]], dim=1
        )
        variances.append(subset.var(dim=1, unbiased=False))
    best_num_highest = torch.stack(variances, dim=1).argmax(dim=1)  # first max = smallest i, (Q,)
    position = torch.arange(group_size, device=rewards.device)  # position in ascending order
    num_lowest = (keep_per_question - best_num_highest).unsqueeze(1)
    keep_sorted = (position < num_lowest) | (position >= group_size - best_num_highest.unsqueeze(1))
    keep_mask = torch.zeros_like(rewards, dtype=torch.bool)
    keep_mask.scatter_(1, ascending, keep_sorted)
    return keep_mask


# the built-in rules, registered by calls (mutmut does not mutate a decorated function)
register_rule("largest_abs")(keep_largest_abs_advantage)
register_rule("smallest_abs")(keep_smallest_abs_advantage)
register_rule("random")(keep_random)
register_rule("max_variance", scopes=("question",), advantages_on_kept=True)(keep_max_reward_variance)
register_rule("unbiased", reweights=True)(keep_by_inclusion)


def _is_int(value) -> bool:
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def select_completions(
    advantages: Tensor,
    rewards: Tensor,
    *,
    num_keep: int,
    scope: str,
    rule: str = "largest_abs",
    generator: torch.Generator | None = None,
) -> Tensor:
    """keep_mask (Q, G) bool with exactly num_keep True, chosen by `rule` within `scope`.

    advantages, rewards: (Q, G). scope 'question' needs num_keep divisible by Q.
    num_keep = 0 keeps nothing (the caller then skips the update).
    """
    if advantages.dim() != 2:
        raise ValueError(f"advantages must be (questions, group_size), got shape {tuple(advantages.shape)}")
    if rewards.shape != advantages.shape:
        raise ValueError(
            f"rewards shape {tuple(rewards.shape)} must equal advantages shape {tuple(advantages.shape)}"
        )
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    allowed = rule_traits(rule).scopes
    if scope not in allowed:
        raise ValueError(f"rule {rule!r} needs scope in {allowed}, got scope={scope!r}")
    num_questions, group_size = advantages.shape
    total = num_questions * group_size
    if not _is_int(num_keep) or not 0 <= num_keep <= total:
        raise ValueError(
            f"num_keep must be an int in [0, {total}] (= questions {num_questions} x group_size {group_size}), got {num_keep!r}"
        )
    if scope == "question" and num_questions > 0 and num_keep % num_questions != 0:
        raise ValueError(
            f"scope='question' keeps the same number per question: num_keep={num_keep} must be "
            f"divisible by the number of questions {num_questions}"
        )
    num_keep = operator.index(num_keep)
    keep_mask = SELECTION_RULES[rule](
        advantages, rewards, num_keep=num_keep, scope=scope, generator=generator
    )
    if keep_mask.shape != advantages.shape or int(keep_mask.sum()) != num_keep:
        raise RuntimeError(
            f"selection rule {rule!r} returned a mask of shape {tuple(keep_mask.shape)} with "
            f"{int(keep_mask.sum())} kept; expected shape {tuple(advantages.shape)} with {num_keep} kept"
        )
    return keep_mask


def select_global(
    all_advantages: Tensor,
    all_rewards: Tensor,
    *,
    num_keep: int,
    rows: slice,
    rule: str = "largest_abs",
    generator: torch.Generator | None = None,
) -> Tensor:
    """keep_mask of `rows` from one step-scope selection over the stacked completions of every
    process (all_advantages, all_rewards: (Q_all, G), process r's questions at rows r*Q..(r+1)*Q);
    num_keep counts over all processes. Every process computes the same mask and takes its rows."""
    keep = select_completions(all_advantages, all_rewards, num_keep=num_keep, scope="step",
                              rule=rule, generator=generator)
    return keep[rows]


def round_keep_mask(advantages: Tensor, rewards: Tensor, *, num_keep: int, rule: str, scope: str,
                    generator: torch.Generator | None, rank: int = 0, world_size: int = 1,
                    gather: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """keep_mask (Q, G) of this process's completions, num_keep of them (per process): the
    global scope over several processes ranks every process's completions (`gather` collects
    a (Q, G) tensor from all of them, rank-major), any other scope this process's own."""
    if scope == GLOBAL_SCOPE and world_size > 1:
        q = advantages.shape[0]
        return select_global(gather(advantages), gather(rewards), num_keep=num_keep * world_size,
                             rows=slice(rank * q, (rank + 1) * q), rule=rule, generator=generator)
    return select_completions(advantages, rewards, num_keep=num_keep, scope=local_scope(scope),
                              rule=rule, generator=generator)


def round_inclusion_weights(advantages: Tensor, *, num_keep: int, scope: str,
                            kept_share: float | None = None, rank: int = 0, world_size: int = 1,
                            gather: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """(Q, G) float64 inclusion weights of this process's completions for a rule with traits
    reweights (`inclusion_weights`), over the same design as `round_keep_mask` (num_keep per
    process; the global scope over several processes: one design over every process's
    completions, num_keep * world_size of them). kept_share: the loss normaliser's kept / all
    over every process (None: the kept share of sequences)."""
    if scope == GLOBAL_SCOPE and world_size > 1:
        q = advantages.shape[0]
        return inclusion_weights(gather(advantages), num_keep=num_keep * world_size, scope="step",
                                 kept_share=kept_share)[rank * q:(rank + 1) * q]
    return inclusion_weights(advantages, num_keep=num_keep, scope=local_scope(scope),
                             kept_share=kept_share)
