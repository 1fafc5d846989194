"""Advantages and losses of the PPO family as pure functions over tensors, and the presets that
name algorithms (GRPO, DAPO, RLOO, GSPO, Dr.GRPO, REINFORCE++, PPO) as settings of them."""

from trainer.algorithms.advantages import (
    GroupMode,
    discounted_returns,
    gae,
    group_advantages,
    group_baseline,
    group_index,
    normalize,
    reinforce_pp_advantages,
    reward_to_go,
    rewards_at_turn_ends,
    turn_values_to_tokens,
)
from trainer.algorithms.aggregation import AggMode, aggregate, loss_normalizer
from trainer.algorithms.config import PRESETS, AlgorithmConfig, algorithm_config
from trainer.algorithms.losses import (
    KL_CLAMP,
    ImportanceLevel,
    KLKind,
    entropy_from_logits,
    explained_variance,
    kl_penalty,
    ppo_policy_loss,
    value_loss,
)
from trainer.algorithms.shaping import drop_uniform_groups, overlong_shaping

__all__ = [
    "KL_CLAMP",
    "PRESETS",
    "AggMode",
    "AlgorithmConfig",
    "GroupMode",
    "ImportanceLevel",
    "KLKind",
    "aggregate",
    "algorithm_config",
    "discounted_returns",
    "drop_uniform_groups",
    "entropy_from_logits",
    "explained_variance",
    "gae",
    "group_advantages",
    "group_baseline",
    "group_index",
    "kl_penalty",
    "loss_normalizer",
    "normalize",
    "overlong_shaping",
    "ppo_policy_loss",
    "reinforce_pp_advantages",
    "reward_to_go",
    "rewards_at_turn_ends",
    "turn_values_to_tokens",
    "value_loss",
]
