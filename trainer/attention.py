"""Per-sequence attention inside packed rows: exact, and linear in the number of sequences.

A packed micro-batch (`trainer.batch`) is one row of whole sequences whose `position_ids`
restart at 0 at each sequence start. transformers' `sdpa` kernel handles that with a block-diagonal
[T, T] mask, so attention costs the square of the whole row however short its sequences are; on
CPU (no flash-attention varlen kernel) that made large token budgets slower than padding.

`VARLEN` is an attention implementation registered with transformers under that name: it splits
each row at its position resets and runs `scaled_dot_product_attention(is_causal=True)` on each
sequence alone, which is what an unpacked forward of that sequence runs. Cost: the sum of the
squares of the sequence lengths. Because the name has no mask function registered, transformers
builds no [T, T] mask for it at all (`masking_utils._preprocess_mask_arguments` returns None).

Contract: the model is called with `position_ids` that restart at 0 at each sequence start (as
`MicroBatch.position_ids_1T`), no attention mask and no KV cache (training and scoring passes
only; generation keeps its own kernel). A row whose positions never reset is one sequence. The
decoder layers must pass `position_ids` on to the attention function (transformers' Llama-family
models, Qwen2 among them, do); otherwise it raises rather than attend across sequences. Under
context parallelism `trainer.parallel.ulysses` calls this kernel on the whole row, for a share of
the heads.

Prefix-shared rows (`trainer.prefix`): a sequence may also start where the position neither resets
nor follows its predecessor, at position p > 0: a branch, whose queries attend to the first p
keys of its trunk (the last sequence that started at 0) and then to its own, causally
(`tree_segments`; an explicit [own, p + own] mask, lower-right causal). That is exactly what the
branch's whole sequence would attend to alone, so its outputs are the flat ones.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

VARLEN = "rlgateway_varlen"
"""The `attn_implementation` name of per-sequence attention."""

_registered = False


def tree_segments(position_ids_T: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """The sequences of a packed row as (start, end, trunk, prefix): a sequence starts at index
    0, wherever the position resets to 0, and wherever it neither resets nor follows its
    predecessor: a prefix-shared branch (`trainer.prefix`) starting at position `prefix`, which
    attends to the first `prefix` tokens of its trunk (the last sequence that started at 0, at
    row index `trunk`) before itself. A sequence starting at 0 is its own trunk, prefix 0."""
    n = int(position_ids_T.shape[0])
    if n == 0:
        return []
    pos = position_ids_T.reshape(-1)
    breaks = (pos[1:] != pos[:-1] + 1) | (pos[1:] == 0)
    starts = [0, *(breaks.nonzero().flatten() + 1).tolist()]
    ends = [*starts[1:], n]
    heads = pos[starts].tolist()
    out: list[tuple[int, int, int, int]] = []
    trunk, trunk_len = 0, 0
    for start, end, head in zip(starts, ends, heads, strict=True):
        if head == 0 or start == 0:
            trunk, trunk_len = start, end - start
            out.append((start, end, start, 0))
            continue
        if head > trunk_len:
            raise ValueError(
                f"a branch at row index {start} starts at position {head}, past its trunk's "
                f"{trunk_len} tokens"
            )
        out.append((start, end, trunk, head))
    return out


def _window_mask(n: int, window: int, device: torch.device, prefix: int = 0) -> torch.Tensor:
    """Causal (sliding-window) mask of `n` queries at positions prefix..prefix+n-1 over keys at
    positions 0..prefix+n-1: query i sees key j with i - window < j <= i in positions."""
    i = torch.arange(prefix, prefix + n, device=device)[:, None]
    j = torch.arange(prefix + n, device=device)[None, :]
    mask = j <= i
    return mask if window <= 0 else mask & (j > i - window)


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface signature: q [B, H, T, D], k/v [B, Hkv, T, D];
    returns [B, T, H, D]. Needs `position_ids` (passed down by the decoder layers)."""
    if attention_mask is not None:
        raise ValueError(
            f"{VARLEN} attention takes no attention mask: pack sequences into one row with "
            "position_ids restarting at 0 (trainer.batch.pack) instead of padding"
        )
    if key.shape[2] != query.shape[2]:
        raise ValueError(f"{VARLEN} attention is for full forwards without a KV cache")
    position_ids = kwargs.get("position_ids")
    if position_ids is None:  # without them the sequences of a packed row would run together
        raise ValueError(
            f"{VARLEN} attention needs the position_ids passed down to the attention layers, "
            "which this model architecture does not do: set backend.attention to sdpa"
        )
    b = query.shape[0]
    position_ids = position_ids.expand(b, -1)
    gqa = query.shape[1] != key.shape[1]
    rows = []
    for row in range(b):
        segments = tree_segments(position_ids[row])
        lengths = [end - start for start, end, _, _ in segments]
        index = {start: k for k, (start, _, _, _) in enumerate(segments)}
        # split, not slicing: its backward is one concatenation, where each slice's backward
        # would write a full-size zero gradient (a cost of sequences x row length per layer)
        qs = torch.split(query[row : row + 1], lengths, dim=2)
        ks = torch.split(key[row : row + 1], lengths, dim=2)
        vs = torch.split(value[row : row + 1], lengths, dim=2)
        parts = []
        for q, k, v, n, (_, _, trunk, prefix) in zip(qs, ks, vs, lengths, segments, strict=True):
            mask = None
            if prefix:  # a branch: its trunk's first `prefix` tokens, then itself
                k = torch.cat([ks[index[trunk]][:, :, :prefix], k], dim=2)
                v = torch.cat([vs[index[trunk]][:, :, :prefix], v], dim=2)
                mask = _window_mask(n, sliding_window or 0, query.device, prefix)
            elif sliding_window is not None and n > sliding_window:
                mask = _window_mask(n, sliding_window, query.device)
            parts.append(
                F.scaled_dot_product_attention(
                    q.contiguous(),
                    k.contiguous(),
                    v.contiguous(),
                    attn_mask=mask,
                    dropout_p=dropout,
                    is_causal=mask is None,
                    scale=scaling,
                    enable_gqa=gqa,
                )
            )
        rows.append(torch.cat(parts, dim=2) if len(parts) > 1 else parts[0])
    out = torch.cat(rows, dim=0) if b > 1 else rows[0]
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Registers `VARLEN` with transformers (idempotent) and returns the name."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(VARLEN, varlen_attention_forward)
        _registered = True
    return VARLEN
