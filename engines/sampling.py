"""Sampling as pure functions over a batch of logits.

Shapes: B = sequences in the decode batch, V = vocabulary. The behaviour logprob reported for a
sampled token is `log_softmax(logits / temperature)` (temperature 1 for greedy rows), taken before
top-k/top-p truncation and min-token masking: the distribution the trainer recomputes.
"""

from __future__ import annotations

import torch


def behaviour_logprobs(logits_BV: torch.Tensor, temperature_B: torch.Tensor) -> torch.Tensor:
    """`log_softmax(logits / T)` in float32 per row; rows with T == 0 (greedy) use T = 1."""
    t_B = torch.where(temperature_B > 0, temperature_B, torch.ones_like(temperature_B))
    return torch.log_softmax(logits_BV.float() / t_B[:, None], dim=-1)


def truncate(logp_BV: torch.Tensor, top_k_B: torch.Tensor, top_p_B: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logprob outside each row's top-k (0 = all) and top-p nucleus.

    The nucleus is the smallest set of most likely tokens whose probability reaches top_p; the most
    likely token is always kept.
    """
    vocab = logp_BV.shape[-1]
    sorted_BV, order_BV = torch.sort(logp_BV, dim=-1, descending=True)
    rank_V = torch.arange(vocab, device=logp_BV.device)
    k_B = torch.where(top_k_B > 0, top_k_B, torch.full_like(top_k_B, vocab))
    probs_BV = sorted_BV.exp()
    mass_before_BV = probs_BV.cumsum(dim=-1) - probs_BV
    # rows with top_p == 1 keep everything: the cumulative sum may round past 1 before the tail
    nucleus_B = top_p_B < 1.0
    drop_BV = (rank_V[None, :] >= k_B[:, None]) | (
        (mass_before_BV >= top_p_B[:, None]) & nucleus_B[:, None]
    )
    drop_BV[:, 0] = False
    sorted_BV = sorted_BV.masked_fill(drop_BV, float("-inf"))
    return torch.empty_like(logp_BV).scatter_(-1, order_BV, sorted_BV)


def sample(
    logp_BV: torch.Tensor,
    *,
    greedy_B: list[bool],
    generators: list[torch.Generator | None],
    shared: torch.Generator | None = None,
) -> torch.Tensor:
    """One token per row: argmax for greedy rows; a draw from `softmax(logp)` with the row's own
    generator for seeded rows (so a seeded request samples the same tokens whatever batch it
    shares); one batched `draw` with `shared` for the unseeded rows."""
    out_B = logp_BV.argmax(dim=-1)
    free = [b for b, (g, gen) in enumerate(zip(greedy_B, generators, strict=True)) if not g]
    if not free:
        return out_B
    probs_BV = logp_BV.exp()
    unseeded = [b for b in free if generators[b] is None]
    if unseeded:
        rows = torch.tensor(unseeded, device=logp_BV.device)
        out_B[rows] = draw(probs_BV[rows], shared)
    for b in free:
        gen = generators[b]
        if gen is not None:  # multinomial, as ever: a seed keeps giving the tokens it gave
            out_B[b] = torch.multinomial(probs_BV[b], 1, generator=gen)[0]
    return out_B


def draw(probs_BV: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One index per row, index i of row b with probability `probs[b, i] / probs[b].sum()`: one
    uniform per row against the row's cumulative sums, in float64 so that no token's share is
    lost to rounding (a zero-probability token is never drawn). `torch.multinomial` draws the
    same distribution about 3.5x slower on CPU over a 49,152-word vocabulary (1.1 ms a row
    against 0.3), a quarter of a 32-sequence decode step of SmolLM2 (`BENCHMARKS.md`)."""
    cdf_BV = probs_BV.double().cumsum(dim=-1)
    u_B1 = torch.rand(
        probs_BV.shape[0], 1, generator=generator, dtype=torch.float64, device=probs_BV.device
    )
    index_B = torch.searchsorted(cdf_BV, u_B1 * cdf_BV[:, -1:], right=True)[:, 0]
    return index_B.clamp_(max=probs_BV.shape[-1] - 1)
