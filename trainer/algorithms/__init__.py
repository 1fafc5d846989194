"""Advantages and losses of the PPO family as pure functions over tensors, and the presets that
name algorithms (GRPO, DAPO, RLOO, GSPO, Dr.GRPO, REINFORCE++, PPO) as settings of them.

The names load on first use (PEP 562), so importing `trainer.algorithms.config` (what validating a
run's config needs) imports no torch; `trainer.algorithms.kinds` holds the settings' names."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.algorithms.advantages import (
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
    from trainer.algorithms.aggregation import aggregate, loss_normalizer
    from trainer.algorithms.config import PRESETS, AlgorithmConfig, algorithm_config
    from trainer.algorithms.kinds import AggMode, GroupMode, ImportanceLevel, KLKind
    from trainer.algorithms.losses import (
        KL_CLAMP,
        entropy_from_logits,
        explained_variance,
        kl_penalty,
        ppo_policy_loss,
        value_loss,
    )
    from trainer.algorithms.shaping import drop_uniform_groups, overlong_shaping

_HOME = {
    "GroupMode": "trainer.algorithms.kinds",
    "discounted_returns": "trainer.algorithms.advantages",
    "gae": "trainer.algorithms.advantages",
    "group_advantages": "trainer.algorithms.advantages",
    "group_baseline": "trainer.algorithms.advantages",
    "group_index": "trainer.algorithms.advantages",
    "normalize": "trainer.algorithms.advantages",
    "reinforce_pp_advantages": "trainer.algorithms.advantages",
    "reward_to_go": "trainer.algorithms.advantages",
    "rewards_at_turn_ends": "trainer.algorithms.advantages",
    "turn_values_to_tokens": "trainer.algorithms.advantages",
    "AggMode": "trainer.algorithms.kinds",
    "aggregate": "trainer.algorithms.aggregation",
    "loss_normalizer": "trainer.algorithms.aggregation",
    "PRESETS": "trainer.algorithms.config",
    "AlgorithmConfig": "trainer.algorithms.config",
    "algorithm_config": "trainer.algorithms.config",
    "KL_CLAMP": "trainer.algorithms.losses",
    "ImportanceLevel": "trainer.algorithms.kinds",
    "KLKind": "trainer.algorithms.kinds",
    "entropy_from_logits": "trainer.algorithms.losses",
    "explained_variance": "trainer.algorithms.losses",
    "kl_penalty": "trainer.algorithms.losses",
    "ppo_policy_loss": "trainer.algorithms.losses",
    "value_loss": "trainer.algorithms.losses",
    "drop_uniform_groups": "trainer.algorithms.shaping",
    "overlong_shaping": "trainer.algorithms.shaping",
}
"""Each public name and the module that defines it."""


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME[name]), name)
    globals()[name] = value
    return value


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
