"""The paper's ideas as pure functions over plain tensors: advantages, selection, allocation, loss."""

from cppo.algorithm.advantages import (
    AGGREGATIONS,
    SCALE_REWARDS,
    check_scale_rewards,
    combine_rewards,
    group_advantages,
    normalized_reward_sum,
    reward_stats,
)
from cppo.algorithm.allocation import StepShape, plan_step
from cppo.algorithm.loss import (IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES, POLICY_TERMS,
                                 SEQUENCE_LEVEL_LOSSES, TOKEN_SUM_LOSSES, entropy_bonus,
                                 gamma_weights,
                                 importance_ratio, importance_weights, masked_mean,
                                 per_token_policy_loss, reduce_loss)
from cppo.algorithm.masks import high_entropy_mask, off_policy_mask
from cppo.algorithm.reference import mix_into_reference
from cppo.algorithm.sampler_correction import (IMPORTANCE_SAMPLING_MODES, sampler_correction_stats,
                                               sampler_importance_weights)
from cppo.algorithm.selection import (
    RULE_TRAITS,
    SCOPES,
    SELECTION_RULES,
    RuleTraits,
    keep_highest_scores,
    recompute_advantages_on_kept,
    register_rule,
    rule_traits,
    select_completions,
    select_global,
)

__all__ = [
    "AGGREGATIONS",
    "normalized_reward_sum",
    "IMPORTANCE_SAMPLING_LEVELS",
    "POLICY_TERMS",
    "SEQUENCE_LEVEL_LOSSES",
    "TOKEN_SUM_LOSSES",
    "entropy_bonus",
    "gamma_weights",
    "high_entropy_mask",
    "importance_ratio",
    "mix_into_reference",
    "off_policy_mask",
    "LOSS_TYPES",
    "RULE_TRAITS",
    "RuleTraits",
    "SCALE_REWARDS",
    "SCOPES",
    "SELECTION_RULES",
    "StepShape",
    "check_scale_rewards",
    "combine_rewards",
    "group_advantages",
    "importance_weights",
    "IMPORTANCE_SAMPLING_MODES",
    "sampler_importance_weights",
    "sampler_correction_stats",
    "keep_highest_scores",
    "masked_mean",
    "per_token_policy_loss",
    "plan_step",
    "recompute_advantages_on_kept",
    "reduce_loss",
    "register_rule",
    "reward_stats",
    "rule_traits",
    "select_completions",
    "select_global",
]
