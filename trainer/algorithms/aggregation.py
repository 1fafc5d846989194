"""Reducing per-token losses to one number, exactly divisible across micro-batches.

Legend: B = rows in a micro-batch, T = token positions, S = sequences.

Aggregation (`agg`) turns per-token losses l[b, t] into a scalar `numerator / normalizer`:

- "token_mean": numerator `sum_{b,t} m l`; default normalizer: the number of sampled tokens.
  AReaL's only mode (a token mean over the global minibatch; no per-sequence length term).
- "seq_mean_token_mean": numerator `sum_b (sum_t m l) / (sum_t m)`; default normalizer: the
  number of sequences with at least one sampled token (original GRPO).
- "seq_mean_token_sum": numerator `sum_b (sum_t m l) / norm_len`, a constant length; default
  normalizer: the number of sequences with a sampled token (Dr.GRPO).
- "token_sum": numerator `sum_{b,t} m l`; default normalizer 1.

With gradient accumulation pass `normalizer=loss_normalizer(agg, num_tokens=..., num_seqs=...)`
counted over the whole batch (all micro-batches, all ranks): the numerators add up across
micro-batches, so the micro-batch losses sum to the full-batch loss exactly. Tokens dropped by the
importance-weight cap stay in the normalizer (AReaL keeps the original token count, so surviving
tokens are not up-weighted).

Sequences. By default each row is one sequence (a padded batch). A packed row holds several: pass
`seq_index_BT`, the int index of the sequence each position belongs to (`MicroBatch.seq_index_1T`);
GSPO and the seq modes then group by it.
"""

from __future__ import annotations

import torch

from trainer.algorithms.kinds import AggMode


def check_bt_shapes(**tensors: torch.Tensor) -> None:
    """Raise ValueError unless all the named tensors share one 2-D [B, T] shape."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != 2:
        raise ValueError(f"these tensors must share one [B, T] shape: {shapes}")


def loss_normalizer(agg: AggMode, *, num_tokens: int, num_seqs: int) -> float:
    """The denominator of `agg` for a batch of `num_tokens` sampled tokens in `num_seqs` sequences
    that have at least one: tokens for "token_mean", sequences for the seq modes, 1 for
    "token_sum"; never less than 1."""
    if agg == "token_sum":
        return 1.0
    count = num_tokens if agg == "token_mean" else num_seqs
    return float(max(count, 1))


def per_sequence_sum(
    x_BT: torch.Tensor, seq_index_BT: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence sums of x (S sequences) and the sequence index of every position."""
    if seq_index_BT is None:
        B, T = x_BT.shape
        idx_BT = torch.arange(B, device=x_BT.device)[:, None].expand(B, T)
        return x_BT.sum(-1), idx_BT
    if seq_index_BT.shape != x_BT.shape:
        raise ValueError(f"seq_index_BT {seq_index_BT.shape} must have the shape {x_BT.shape}")
    idx_BT = seq_index_BT.long()
    n_seqs = int(idx_BT.max()) + 1 if idx_BT.numel() else 0
    zeros_S = torch.zeros(n_seqs, dtype=x_BT.dtype, device=x_BT.device)
    return zeros_S.index_add(0, idx_BT.flatten(), x_BT.flatten()), idx_BT


def aggregate(
    loss_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    agg: AggMode,
    *,
    norm_len: float | None = None,
    normalizer: float | None = None,
    seq_index_BT: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce per-token losses to a scalar as the module docstring defines; masked entries are
    ignored even if they hold inf or nan. Without `normalizer`, this batch's own count is used."""
    check_bt_shapes(loss_BT=loss_BT, mask_BT=mask_BT)
    m = mask_BT.bool()
    masked_BT = torch.where(m, loss_BT, torch.zeros_like(loss_BT))
    count_S, _ = per_sequence_sum(m.to(loss_BT.dtype), seq_index_BT)
    if agg in ("token_mean", "token_sum"):
        numerator = masked_BT.sum()
    elif agg == "seq_mean_token_mean":
        numerator = (per_sequence_sum(masked_BT, seq_index_BT)[0] / count_S.clamp(min=1)).sum()
    elif agg == "seq_mean_token_sum":
        if norm_len is None or norm_len <= 0:
            raise ValueError("agg seq_mean_token_sum needs norm_len > 0 (e.g. the max_tokens)")
        numerator = masked_BT.sum() / norm_len
    else:
        raise ValueError(f"unknown agg {agg!r}")
    if normalizer is None:
        num_seqs = int((count_S > 0).sum())
        normalizer = loss_normalizer(agg, num_tokens=int(m.sum()), num_seqs=num_seqs)
    return numerator / normalizer
