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
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

VARLEN = "rlgateway_varlen"
"""The `attn_implementation` name of per-sequence attention."""

_registered = False


def segment_bounds(position_ids_T: torch.Tensor) -> list[tuple[int, int]]:
    """Half-open [start, end) of each sequence of a packed row: a new one starts wherever the
    position resets to 0 (and at index 0)."""
    n = int(position_ids_T.shape[0])
    if n == 0:
        return []
    starts = (position_ids_T == 0).nonzero().flatten().tolist()
    if not starts or starts[0] != 0:
        starts = [0, *starts]
    ends = [*starts[1:], n]
    return list(zip(starts, ends, strict=True))


def _window_mask(n: int, window: int, device: torch.device) -> torch.Tensor:
    """Causal sliding-window mask: query i sees keys j with i - window < j <= i."""
    i = torch.arange(n, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    return (j <= i) & (j > i - window)


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
        bounds = segment_bounds(position_ids[row])
        lengths = [end - start for start, end in bounds]
        # split, not slicing: its backward is one concatenation, where each slice's backward
        # would write a full-size zero gradient (a cost of sequences x row length per layer)
        qs = torch.split(query[row : row + 1], lengths, dim=2)
        ks = torch.split(key[row : row + 1], lengths, dim=2)
        vs = torch.split(value[row : row + 1], lengths, dim=2)
        parts = []
        for q, k, v, n in zip(qs, ks, vs, lengths, strict=True):
            mask = None
            if sliding_window is not None and n > sliding_window:
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
