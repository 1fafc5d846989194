"""`engines.weights.all_finite`, the check every weight update's tensors pass before the engine
copies the first one: a single NaN or inf anywhere, in the model's dtype, is found."""

from __future__ import annotations

import pytest
import torch

from engines.weights import all_finite


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("at", [0, 123_456, 999_999])
def test_one_non_finite_value_anywhere_is_found(bad: float, at: int) -> None:
    t = torch.randn(1_000_000)
    assert all_finite(t)
    t[at] = bad
    assert not all_finite(t)
    assert not all_finite(t.to(torch.bfloat16))


def test_a_float32_value_beyond_bfloat16_is_the_inf_it_becomes() -> None:
    t = torch.randn(64)
    t[7] = 3.40e38  # finite in float32, inf in bfloat16
    assert all_finite(t)
    assert not all_finite(t.to(torch.bfloat16))


def test_an_empty_tensor_and_extreme_finite_values_pass() -> None:
    assert all_finite(torch.empty(0))
    big = torch.finfo(torch.float32).max
    assert all_finite(torch.tensor([-big, 0.0, big]))
