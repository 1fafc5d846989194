"""Algorithm presets and overrides."""

from __future__ import annotations

from typing import Any

import pydantic
import pytest

from trainer.algorithms import PRESETS, AlgorithmConfig, algorithm_config

# What each preset is documented to set (trainer/algorithms/config.py, from AReaL's matrix).
EXPECTED: dict[str, dict[str, Any]] = {
    "ppo": {"use_critic": True, "group_baseline": "none", "value_clip": 0.5, "lam": 1.0},
    "grpo": {"group_baseline": "mean_std", "eps_low": 0.4, "eps_high": 0.4, "decoupled": True},
    "dapo": {
        "eps_low": 0.2,
        "eps_high": 0.28,
        "agg": "token_mean",
        "overlong_buffer": 512,
        "overlong_penalty_factor": 1.0,
        "dynamic_sampling": True,
        "kl_coef": 0.0,
    },
    "rloo": {"group_baseline": "leave_one_out", "adv_norm": "batch"},
    "gspo": {"group_baseline": "mean_std", "importance_level": "sequence", "eps_high": 4e-4},
    "dr_grpo": {"group_baseline": "mean", "adv_norm": "batch"},
    "reinforce_pp": {
        "group_baseline": "none",
        "kl_coef": 0.001,
        "kl_kind": "k1",
        "kl_placement": "reward",
        "adv_norm": "batch",
    },
}


def test_presets_load_and_set_what_they_document() -> None:
    assert set(PRESETS) == set(EXPECTED)
    for name, fields in EXPECTED.items():
        cfg = algorithm_config(name)
        assert cfg == PRESETS[name]
        for key, value in fields.items():
            assert getattr(cfg, key) == value, (name, key)
        assert cfg.behav_imp_weight_cap == 5.0
        assert cfg.use_critic == (name == "ppo")
        assert (cfg.importance_level == "sequence") == (name == "gspo")
        assert cfg.dynamic_sampling == (name == "dapo")


def test_presets_are_pairwise_different() -> None:
    dumps = [tuple(sorted(p.model_dump().items())) for p in PRESETS.values()]
    assert len(set(dumps)) == len(dumps)


def test_every_field_has_a_docstring() -> None:
    for name, field in AlgorithmConfig.model_fields.items():
        assert field.description, name


def test_every_knob_is_overridable() -> None:
    overrides: dict[str, Any] = {
        "group_baseline": "leave_one_out",
        "adv_norm": "none",
        "norm_eps": 1e-6,
        "use_critic": True,
        "lam": 0.95,
        "value_clip": None,
        "eps_low": 0.1,
        "eps_high": 0.3,
        "dual_clip_c": 3.0,
        "decoupled": False,
        "behav_imp_weight_cap": None,
        "behav_imp_weight_mode": "mask",  # the only mode without a cap, or not decoupled
        "importance_level": "sequence",
        "agg": "seq_mean_token_sum",
        "norm_len": 4096,
        "kl_coef": 0.01,
        "kl_kind": "k2",
        "kl_placement": "reward",
        "entropy_coef": 0.001,
        "ppo_n_minibatches": 2,
        "ppo_minibatch_split": "prefixes",
        "ppo_epochs": 3,
        "overlong_buffer": 128,
        "overlong_penalty_factor": 0.5,
        "dynamic_sampling": True,
        "zero_truncated_reward": True,
    }
    assert set(overrides) == set(AlgorithmConfig.model_fields)
    cfg = algorithm_config("grpo", **overrides)
    assert cfg.model_dump() == overrides
    assert PRESETS["grpo"].eps_low == 0.4  # the registry is not mutated


def test_unknown_preset_lists_the_names() -> None:
    with pytest.raises(ValueError, match="unknown algorithm 'ppo2'") as err:
        algorithm_config("ppo2")
    for name in PRESETS:
        assert name in str(err.value)


def test_unknown_override_names_the_key() -> None:
    with pytest.raises(pydantic.ValidationError, match="eps_clip"):
        algorithm_config("dapo", eps_clip=0.3)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"dual_clip_c": 0.5}, "dual_clip_c"),
        ({"behav_imp_weight_cap": 1.0}, "behav_imp_weight_cap=1.0 is not above 1"),
        ({"behav_imp_weight_cap": 0.5, "behav_imp_weight_mode": "icepop"}, "set it above 1"),
        ({"behav_imp_weight_cap": None, "behav_imp_weight_mode": "truncate"}, "set behav_imp"),
        ({"decoupled": False, "behav_imp_weight_mode": "icepop"}, "set decoupled=true"),
        ({"behav_imp_weight_mode": "clip"}, "behav_imp_weight_mode"),
        ({"agg": "seq_mean_token_sum"}, "set norm_len"),
        ({"group_baseline": "median"}, "group_baseline"),
        ({"lam": 1.5}, "lam"),
    ],
)
def test_bad_values_are_rejected_clearly(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=message):
        algorithm_config("grpo", **overrides)


@pytest.mark.parametrize("mode", ["mask", "truncate", "icepop"])
def test_every_behaviour_weight_mode_loads_with_the_cap(mode: str) -> None:
    cfg = algorithm_config("grpo", behav_imp_weight_mode=mode, behav_imp_weight_cap=2.0)
    assert (cfg.behav_imp_weight_mode, cfg.behav_imp_weight_cap) == (mode, 2.0)
    assert PRESETS["grpo"].behav_imp_weight_mode == "mask"  # AReaL's: the default everywhere


def test_config_is_frozen() -> None:
    with pytest.raises(pydantic.ValidationError):
        PRESETS["grpo"].eps_low = 0.1


def test_a_run_config_refuses_an_overlong_buffer_longer_than_max_tokens() -> None:
    from trainer.config import load_config

    with pytest.raises(ValueError, match=r"overlong_buffer \(512\) exceeds max_tokens \(10\)"):
        load_config(None, ["algorithm=dapo", "max_tokens=10"])
    assert load_config(None, ["algorithm=dapo", "max_tokens=10", "algo.overlong_buffer=5"])
