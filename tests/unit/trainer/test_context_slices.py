"""Context parallelism's row layout (`trainer.parallel.context`): padding and slicing of a packed
row, without communication."""

from __future__ import annotations

import itertools

import pytest
import torch

from trainer.attention import tree_segments
from trainer.batch import MicroBatch, TrainSequence, pack
from trainer.parallel.context import padded_length, slice_bounds, slice_row


def sequence(tokens: list[int]) -> TrainSequence:
    n = len(tokens)
    return TrainSequence(
        tokens=tokens,
        loss_mask=[0] + [1] * (n - 1),
        behav_logprobs=[0.0] + [-1.0] * (n - 1),
        advantages=[0.0] + [1.0] * (n - 1),
        versions=[-1] + [0] * (n - 1),
        temperatures=[0.5 + 0.1 * t for t in range(n)],
    )


@pytest.fixture
def row() -> MicroBatch:
    """One packed row of 3 sequences, 5 + 4 + 2 = 11 tokens (odd)."""
    seqs = [sequence([10, 11, 12, 13, 14]), sequence([20, 21, 22, 23]), sequence([30, 31])]
    (mb,) = pack(seqs, token_budget=64)
    assert mb.seq_lens == (5, 4, 2)
    return mb


@pytest.mark.parametrize(
    ("length", "size", "padded"), [(11, 2, 12), (12, 2, 12), (1, 2, 2), (5, 4, 8), (3, 1, 3)]
)
def test_a_row_pads_to_a_multiple_of_the_context_size(length: int, size: int, padded: int) -> None:
    assert padded_length(length, size) == padded
    bounds = [slice_bounds(padded, size, r) for r in range(size)]
    assert bounds[0][0] == 0
    assert bounds[-1][1] == padded
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    assert len({end - start for start, end in bounds}) == 1


@pytest.mark.parametrize("size", [2, 3, 4])
def test_the_slices_are_the_padded_row_in_order(row: MicroBatch, size: int) -> None:
    parts = [
        slice_row(
            row.input_ids_1T,
            row.position_ids_1T,
            row.targets_1T,
            row.temperature_1T,
            size,
            r,
        )
        for r in range(size)
    ]
    padded = padded_length(11, size)
    pad = padded - 11
    assert all((p.length, p.padded) == (11, padded) for p in parts)

    def joined(name: str) -> list[float]:
        return torch.cat([getattr(p, name) for p in parts], dim=1)[0].tolist()

    assert joined("input_ids_1L") == row.input_ids_1T[0].tolist() + [0] * pad
    assert joined("targets_1L") == row.targets_1T[0].tolist() + [0] * pad
    assert row.temperature_1T is not None
    assert joined("temperature_1L") == row.temperature_1T[0].tolist() + [1.0] * pad
    # the row's own positions, then the padding as a sequence of its own
    positions = row.position_ids_1T[0].tolist() + list(range(pad))
    assert joined("position_ids_1L") == positions
    assert all(p.row_position_ids_1P[0].tolist() == positions for p in parts)
    bounds = [(a, b) for a, b, _, _ in tree_segments(parts[0].row_position_ids_1P[0])]
    assert bounds == [(0, 5), (5, 9), (9, 11)] + ([(11, padded)] if pad else [])


def test_a_slice_keeps_the_row_targets_across_its_boundary(row: MicroBatch) -> None:
    # 12 padded tokens over 2 ranks: the second sequence (positions 5-8) crosses at 6
    first, second = (
        slice_row(row.input_ids_1T, row.position_ids_1T, row.targets_1T, None, 2, r) for r in (0, 1)
    )
    assert (first.start, first.end, second.start, second.end) == (0, 6, 6, 12)
    assert first.input_ids_1L[0, -1] == 20
    assert second.input_ids_1L[0, 0] == 21
    # the last position of the first slice predicts the first token of the second
    assert first.targets_1L[0, -1] == second.input_ids_1L[0, 0] == 21
    assert second.position_ids_1L[0].tolist() == [1, 2, 3, 0, 1, 0]
    assert first.temperature_1L is None
