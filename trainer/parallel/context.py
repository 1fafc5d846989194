"""Context parallelism's layout of a packed row: each context rank holds one contiguous slice.

Legend: T = the packed row's tokens, P = T padded to a multiple of the context size c,
L = P / c, the tokens of one slice.

Every rank of a context group packs the same micro-batches (they train the same sequences), so
each can cut the row itself, without communication: the row is padded at its end to P tokens and
context rank r takes positions [r L, (r + 1) L). The padding is a sequence of its own (input id
0, position ids 0, 1, ... so that the per-sequence attention sees a reset where it starts, target
0, temperature 1): causal attention keeps every real token from seeing it, and its outputs are
dropped before any loss sees them (`gather_row` returns the first T positions only), so it
carries neither loss nor gradient.

A slice keeps the row's own position ids (rotary embeddings see each token's true position), and
the row's shifted targets: the target at row position i is the token at i + 1 of the same
sequence even when i is the last position of a slice and i + 1 the first of the next, so a
slice's logprobs are the row's logprobs at its positions. Attention is the one layer that needs
the whole row (`trainer.parallel.ulysses` trades tokens for heads around it, and needs the padded
row's position ids to find its sequences); everything else (embedding, norms, MLP, LM head,
logprobs, entropies) runs on the slice.

The per-position results come back whole: `gather_row` all-gathers every slice's [1, L] values
into the row's [1, T] on every context rank. It is differentiable, its backward taking this
rank's slice of the gradient: every context rank computes the same loss from the same gathered
row, and each back-propagates that loss only through its own slice, so the context ranks' weight
gradients sum to the gradient of the one loss (the backend scales for FSDP's averaging over
them). Loss callbacks therefore see the whole micro-batch, and those that group by sequence (the
seq-mean aggregations, GSPO's sequence ratio) stay exact when a sequence crosses a slice boundary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class ContextGroup:
    """This rank's place in its context group: rank `rank` of `size`, communicating over `group`."""

    rank: int
    size: int
    group: dist.ProcessGroup


@dataclass(frozen=True, slots=True, kw_only=True)
class RowSlice:
    """One context rank's slice [start, end) of a packed row of `length` tokens padded to `padded`
    (a multiple of the context size). Every `_1L` tensor is [1, end - start]."""

    input_ids_1L: torch.Tensor
    """int64 token ids of the slice (0 on padding)."""
    position_ids_1L: torch.Tensor
    """int64 position ids of the slice, the row's own."""
    targets_1L: torch.Tensor
    """int64 shifted targets of the slice, the row's own (0 on padding)."""
    temperature_1L: torch.Tensor | None
    """float32 per-target temperatures of the slice (1 on padding), if the row has them."""
    row_position_ids_1P: torch.Tensor
    """int64 position ids of the whole padded row, where attention finds its sequences."""
    length: int
    """Tokens of the unpadded row."""
    padded: int
    """Tokens of the padded row."""
    start: int
    end: int


def padded_length(length: int, size: int) -> int:
    """`length` rounded up to a multiple of `size` (at least `size`: every slice has a token)."""
    return max(size, -(-length // size) * size)


def slice_bounds(padded: int, size: int, rank: int) -> tuple[int, int]:
    """[start, end) of context rank `rank`'s slice of a row of `padded` tokens (a multiple of
    `size`)."""
    assert padded % size == 0, f"a row of {padded} tokens does not split into {size} slices"
    step = padded // size
    return rank * step, (rank + 1) * step


def pad_positions(position_ids_1T: torch.Tensor, padded: int) -> torch.Tensor:
    """The row's position ids followed by 0, 1, ... up to `padded` entries: the padding is a
    sequence of its own."""
    extra = padded - position_ids_1T.shape[1]
    tail = torch.arange(extra, dtype=position_ids_1T.dtype, device=position_ids_1T.device)
    return torch.cat([position_ids_1T, tail[None]], dim=1)


def pad_values(values_1T: torch.Tensor, padded: int, fill: float | int) -> torch.Tensor:
    """`values_1T` followed by `fill` up to `padded` entries."""
    extra = padded - values_1T.shape[1]
    return torch.nn.functional.pad(values_1T, (0, extra), value=fill)


def slice_row(
    input_ids_1T: torch.Tensor,
    position_ids_1T: torch.Tensor,
    targets_1T: torch.Tensor,
    temperature_1T: torch.Tensor | None,
    size: int,
    rank: int,
) -> RowSlice:
    """Context rank `rank`'s slice (of `size`) of a packed row, padded as the module says."""
    length = int(input_ids_1T.shape[1])
    padded = padded_length(length, size)
    start, end = slice_bounds(padded, size, rank)
    positions_1P = pad_positions(position_ids_1T, padded)
    temperature_1L = None
    if temperature_1T is not None:
        temperature_1L = pad_values(temperature_1T, padded, 1.0)[:, start:end]
    return RowSlice(
        input_ids_1L=pad_values(input_ids_1T, padded, 0)[:, start:end],
        position_ids_1L=positions_1P[:, start:end],
        targets_1L=pad_values(targets_1T, padded, 0)[:, start:end],
        temperature_1L=temperature_1L,
        row_position_ids_1P=positions_1P,
        length=length,
        padded=padded,
        start=start,
        end=end,
    )


class _GatherSlices(torch.autograd.Function):
    """[1, L] slices of every context rank -> the padded [1, P] row; backward: this rank's
    slice of the row's gradient (every rank holds the gradient of the same loss)."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        values_1L: torch.Tensor,
        context: ContextGroup,
    ) -> torch.Tensor:
        local = values_1L.contiguous()
        parts = [torch.empty_like(local) for _ in range(context.size)]
        dist.all_gather(parts, local, group=context.group)
        ctx.bounds = (context.rank * local.shape[1], (context.rank + 1) * local.shape[1])  # type: ignore[attr-defined]
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_1P: torch.Tensor
    ) -> tuple[torch.Tensor, None]:
        start, end = ctx.bounds  # type: ignore[attr-defined]
        return grad_1P[:, start:end].contiguous(), None


def gather_row(values_1L: torch.Tensor, part: RowSlice, context: ContextGroup) -> torch.Tensor:
    """The [1, T] row of per-position values (the padding dropped) from every context rank's
    [1, L] slice of them, on every rank of `context`; differentiable (module docstring). Every
    rank of the group calls it."""
    assert values_1L.shape[1] == part.end - part.start, (values_1L.shape, part.start, part.end)
    row_1P = _GatherSlices.apply(values_1L, context)  # type: ignore[no-untyped-call]
    assert isinstance(row_1P, torch.Tensor)
    return row_1P[:, : part.length]
