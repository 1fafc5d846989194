"""Ulysses attention (DeepSpeed-Ulysses): a context group trades tokens for heads around attention.

Each context rank holds a slice of a packed row's tokens (`trainer.parallel.context`) and, going
into attention, its q, k, v for all of its heads: [B, H, L, D] (H the heads of this tensor rank).
One all-to-all per tensor over the context group of c ranks sends head group j to rank j and
receives every rank's tokens of its own group: [B, H / c, c L, D], the whole row for H / c heads,
in slice order. The row's attention runs on that unchanged (the per-sequence `trainer.attention`
kernel, given the whole padded row's position ids so that it finds every sequence of the row,
padding included, exactly as without context parallelism), and the inverse all-to-all returns
[B, L, H, D], this rank's tokens for all heads, for `o_proj`. Attention is per head, so the result
is the one-rank result; the all-to-alls move activations only, 4 per layer (3 + 1), each of
1 / c of the layer's q, k, v or output.

Key-value heads fewer than c (GQA) are repeated first, each c / Hkv times in place
(`repeat_interleave`), so that rank j's key-value heads are those its query heads read:
query head h reads key-value head h // (H / Hkv), and the query heads of one rank, H / c
consecutive ones, all fall in one group of H / Hkv. `validate_for_model` admits only key-value
counts that divide by c or divide c.

`ULYSSES` is registered with transformers' `AttentionInterface`, so the Hugging Face modeling code
runs unmodified: a model loaded with `attn_implementation=ULYSSES` calls `ulysses_attention_forward`
from every attention layer with its usual arguments plus the `ulysses` keyword (a `UlyssesRow`),
which the backend passes to the model's forward and transformers hands down to the attention
function (as it does flash-attention's varlen keywords). Like the per-sequence kernel it has no
mask function, so transformers builds no mask (a mask built from a slice's positions would be
wrong for the whole row anyway).

The all-to-all is differentiable: its backward is the inverse all-to-all of the gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from trainer.attention import varlen_attention_forward

ULYSSES = "rlgateway_ulysses"
"""The `attn_implementation` name of Ulysses attention around the per-sequence kernel."""

_registered = False


@dataclass(frozen=True, slots=True)
class UlyssesRow:
    """What Ulysses attention needs beyond transformers' arguments: the context group and the whole
    padded row's position ids [1, P] (where its sequences start)."""

    group: dist.ProcessGroup
    size: int
    position_ids_1P: torch.Tensor


def _exchange(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: Any) -> torch.Tensor:
    """Chunk j of `x` along `scatter_dim` goes to rank j; the chunks received, from rank 0 up,
    are concatenated along `gather_dim`."""
    size = dist.get_world_size(group)
    send = torch.stack(x.chunk(size, dim=scatter_dim)).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        scatter_dim: int,
        gather_dim: int,
        group: Any,
    ) -> torch.Tensor:
        ctx.dims = (scatter_dim, gather_dim)  # type: ignore[attr-defined]
        ctx.group = group  # type: ignore[attr-defined]
        return _exchange(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor, None, None, None]:
        scatter_dim, gather_dim = ctx.dims  # type: ignore[attr-defined]
        return _exchange(grad, gather_dim, scatter_dim, ctx.group), None, None, None  # type: ignore[attr-defined]


def all_to_all(
    x: torch.Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup
) -> torch.Tensor:
    """Differentiable all-to-all over `group`: `x` split into equal chunks along `scatter_dim`,
    chunk j to rank j, the received chunks concatenated along `gather_dim` in rank order. Every
    rank of the group calls it with the same shape."""
    out = _AllToAll.apply(x, scatter_dim, gather_dim, group)  # type: ignore[no-untyped-call]
    assert isinstance(out, torch.Tensor)
    return out


def ulysses_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    ulysses: UlyssesRow | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface signature on a slice of the row: q [B, H, L, D],
    k/v [B, Hkv, L, D]; returns [B, L, H, D]. Needs `ulysses` (module docstring)."""
    if ulysses is None:
        raise ValueError(
            f"{ULYSSES} attention needs the `ulysses` keyword (a UlyssesRow) in the model's "
            "forward: it runs under the FSDP backend's context parallelism only"
        )
    size, group = ulysses.size, ulysses.group
    heads, kv_heads = query.shape[1], key.shape[1]
    assert heads % size == 0, f"{heads} heads do not split over {size} context ranks"
    if kv_heads % size:
        assert size % kv_heads == 0, f"{kv_heads} key-value heads and {size} context ranks"
        key = key.repeat_interleave(size // kv_heads, dim=1)
        value = value.repeat_interleave(size // kv_heads, dim=1)
    # [B, heads, L, D] -> [B, heads / c, P, D]: the whole row for this rank's heads
    q, k, v = (all_to_all(x, 1, 2, group) for x in (query, key, value))
    kwargs["position_ids"] = ulysses.position_ids_1P
    out, _ = varlen_attention_forward(module, q, k, v, attention_mask, **kwargs)
    # [B, P, heads / c, D] -> [B, L, heads, D]: this rank's tokens for every head
    return all_to_all(out, 1, 2, group), None


def register() -> str:
    """Registers `ULYSSES` with transformers (idempotent) and returns the name."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(ULYSSES, ulysses_attention_forward)
        _registered = True
    return ULYSSES
