"""One rule merges the stats of an update's parts (micro-batches, optimizer steps)."""

from __future__ import annotations

import math

from trainer.loop import merge_update_stats
from trainer.stats import merge_stats


def test_minima_maxima_sums_and_token_weighted_means() -> None:
    parts = [
        (3.0, {"loss": 0.5, "ratio_min": 0.9, "ratio_max": 1.1, "entropy": 1.0}),
        (1.0, {"loss": 0.25, "ratio_min": 0.7, "ratio_max": 1.4, "entropy": 3.0}),
    ]
    out = merge_stats(parts, summed={"loss"})
    assert out == {"loss": 0.75, "ratio_min": 0.7, "ratio_max": 1.4, "entropy": 1.5}


def test_a_part_that_trained_nothing_does_not_set_an_extreme() -> None:
    # an empty micro-batch's ratio stats are placeholders, not observations
    parts = [(2.0, {"ratio_min": 0.8, "clip": 0.5}), (0.0, {"ratio_min": 0.0, "clip": 1.0})]
    out = merge_stats(parts)
    assert out["ratio_min"] == 0.8
    assert out["clip"] == 0.5
    # where no part trained a token, the plain mean and the plain extremes
    assert merge_stats(
        [(0.0, {"clip": 1.0, "x_max": 2.0}), (0.0, {"clip": 0.0, "x_max": 3.0})]
    ) == {
        "clip": 0.5,
        "x_max": 3.0,
    }


def test_a_stat_only_some_parts_have_is_weighted_over_those() -> None:
    out = merge_stats([(1.0, {"a": 2.0}), (3.0, {"b": 4.0})])
    assert out == {"a": 2.0, "b": 4.0}


def test_a_training_step_averages_its_optimizer_steps_losses_and_keeps_the_first_lr() -> None:
    updates = [
        (10, {"loss": 1.0, "grad_norm": 2.0, "lr": 1e-4, "ratio_max": 1.2, "entropy": 2.0}),
        (30, {"loss": 3.0, "grad_norm": 4.0, "lr": 5e-5, "ratio_max": 1.5, "entropy": 1.0}),
    ]
    out = merge_update_stats(updates)
    assert out["loss"] == 2.0
    assert out["grad_norm"] == 3.0
    assert out["grad_norm_max"] == 4.0
    assert out["lr"] == 1e-4
    assert out["ratio_max"] == 1.5
    assert out["entropy"] == 1.25
    inf = merge_update_stats([(1, {"grad_norm": math.inf}), (1, {"grad_norm": 1.0})])
    assert inf["grad_norm_max"] == math.inf
