"""DAPO reward shaping and dynamic sampling."""

from __future__ import annotations

import random

import pytest
import torch

from trainer.algorithms import drop_uniform_groups, overlong_shaping


def test_overlong_shaping_by_hand() -> None:
    # max_len 20, buffer 4: free up to 16 tokens, then -1/4 per token, -factor at 20
    reward = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    length = torch.tensor([3, 16, 17, 20, 18])
    got = overlong_shaping(reward, length, max_len=20, overlong_buffer=4)
    assert got.tolist() == pytest.approx([1.0, 1.0, 0.75, 0.0, -0.5])
    doubled = overlong_shaping(reward, length, max_len=20, overlong_buffer=4, penalty_factor=2.0)
    assert doubled.tolist() == pytest.approx([1.0, 1.0, 0.5, -1.0, -1.0])


def test_overlong_shaping_is_bounded_by_the_penalty_at_max_len() -> None:
    # max_len 20, buffer 4: past 20 tokens the penalty stays -factor (unbounded, 4,000 tokens
    # would take a reward of 1 to 1 - 996)
    reward = torch.tensor([1.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    length = torch.tensor([20, 21, 4000, 100])
    got = overlong_shaping(reward, length, max_len=20, overlong_buffer=4)
    assert got.tolist() == pytest.approx([0.0, 0.0, 0.0, -1.0])
    half = overlong_shaping(reward, length, max_len=20, overlong_buffer=4, penalty_factor=0.5)
    assert half.tolist() == pytest.approx([0.5, 0.5, 0.5, -0.5])


def test_overlong_shaping_rejects_a_bad_buffer() -> None:
    r, n = torch.zeros(2), torch.tensor([1, 2])
    with pytest.raises(ValueError, match="overlong_buffer must be in"):
        overlong_shaping(r, n, max_len=10, overlong_buffer=11)
    with pytest.raises(ValueError, match="overlong_buffer must be in"):
        overlong_shaping(r, n, max_len=10, overlong_buffer=0)


def test_drop_uniform_groups_by_id_not_position() -> None:
    rewards = [1.0, 0.0, 1.0, 1.0, 0.5, 0.5, 2.0, 0.0]
    ids: list[str | None] = ["a", "b", "a", "b", "c", "c", None, "d"]
    keep = {"a": False, "b": True, "c": False, None: False, "d": False}  # d is a singleton
    rng = random.Random(0)
    for _ in range(4):
        order = list(range(len(rewards)))
        rng.shuffle(order)
        got = drop_uniform_groups(
            torch.tensor([rewards[i] for i in order]), [ids[i] for i in order]
        )
        assert got.dtype == torch.bool
        assert got.tolist() == [keep[ids[i]] for i in order]
