"""Configs that would train silently wrong are refused at load, with a message that says what to
write: a group baseline over groups of one (every advantage 0), and DAPO's overlong shaping with
no `max_tokens` to shape by (no shaping at all)."""

from __future__ import annotations

import pytest

from trainer.algorithms.config import PRESETS, algorithm_config
from trainer.config import TrainConfig, load_config

GROUPED = sorted(name for name, p in PRESETS.items() if p.group_baseline != "none")


def test_the_default_config_loads_and_trains_groups() -> None:
    cfg = load_config(None)
    assert cfg.algorithm_config().group_baseline != "none"
    assert cfg.group_size >= 2
    assert cfg.batch_size % cfg.group_size == 0


@pytest.mark.parametrize("algorithm", GROUPED)
def test_a_group_baseline_over_groups_of_one_is_refused(algorithm: str) -> None:
    given = [f"algorithm={algorithm}", "group_size=1", "max_tokens=1024"]
    with pytest.raises(ValueError, match="with group_size 1 every advantage is 0") as err:
        load_config(None, given)
    message = str(err.value)
    assert "set group_size >= 2" in message
    assert "group_id" in message
    assert "ppo, reinforce_pp" in message
    # a group baseline turned off, or an algorithm without one, trains groups of one
    assert load_config(None, [*given, "algo.group_baseline=none"]).group_size == 1
    assert load_config(None, [*given, "group_size=2"]).group_size == 2


@pytest.mark.parametrize("algorithm", ["ppo", "reinforce_pp"])
def test_an_algorithm_without_a_group_baseline_takes_groups_of_one(algorithm: str) -> None:
    assert load_config(None, [f"algorithm={algorithm}", "group_size=1"]).group_size == 1


def test_overlong_shaping_without_max_tokens_is_refused() -> None:
    with pytest.raises(ValueError, match="set max_tokens") as err:
        load_config(None, ["algorithm=dapo"])
    assert "algo.overlong_buffer=null" in str(err.value)
    with pytest.raises(ValueError, match="set max_tokens"):
        load_config(None, ["algo.overlong_buffer=8"])  # any algorithm that shapes
    assert load_config(None, ["algorithm=dapo", "max_tokens=1024"]).max_tokens == 1024
    shaping_off = load_config(None, ["algorithm=dapo", "algo.overlong_buffer=null"])
    assert shaping_off.algorithm_config().overlong_buffer is None


def test_max_tokens_is_the_runs() -> None:
    from store.run_config import RUN_FIELDS, RunConfig, run_config_of

    assert "max_tokens" in RUN_FIELDS
    assert run_config_of({"max_tokens": 8, "algorithm": "dapo"}) == RunConfig(max_tokens=8)
    cfg = TrainConfig(run="r", max_tokens=64)
    assert cfg.algorithm_config().norm_len == 64  # the trainer reads the same value


def test_the_algorithm_and_the_allocation_are_resolved_once_and_follow_a_copy() -> None:
    """Resolved when the config is validated (the same object at every use), and again for a
    copy whose fields differ: a copy never carries its original's algorithm."""
    cfg = TrainConfig(run="r", algorithm="grpo", backend="fsdp:d2")
    assert cfg.algorithm_config() is cfg.algorithm_config()
    assert cfg.allocation.backend == "fsdp"
    assert cfg.allocation.strategy.data == 2
    dapo = cfg.model_copy(update={"algorithm": "dapo", "backend": "fsdp:d1"})
    assert dapo.algorithm_config() == algorithm_config("dapo")
    assert dapo.algorithm_config() != cfg.algorithm_config()
    assert dapo.allocation.strategy.data == 1
    same = cfg.model_copy(update={"run": "other"})
    assert same.algorithm_config() == cfg.algorithm_config()
