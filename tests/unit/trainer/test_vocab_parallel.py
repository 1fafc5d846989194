"""The vocab-parallel softmax math (`trainer.parallel.vocab`) on simulated vocabulary slices: each
slice's partial statistics, combined as the all-reduces combine them (max, then sum), give the
logprobs, entropies and gradients of a float64 softmax over the whole vocabulary, for uneven
slices, an empty slice and per-position temperatures."""

from __future__ import annotations

import pytest
import torch

from trainer.batch import token_entropy, token_logprobs
from trainer.parallel.vocab import (
    entropy_from_partials,
    logprobs_from_partials,
    shard_entropy_grad,
    shard_entropy_partials,
    shard_logprob_grad,
    shard_logprob_partials,
    shard_max,
    vocab_slice,
)

CHUNK = 3
"""Fewer positions than the rows below, so every pass runs over several chunks."""


def simulated(
    logits_TV: torch.Tensor, targets_T: torch.Tensor, temp_T: torch.Tensor, grad_T: torch.Tensor
) -> dict[str, list[torch.Tensor]]:
    """Logprobs, entropies and both gradients for every number of slices 1..4 (and 4 slices of 5
    ids, one of them empty, for a 5-id vocabulary), as the ranks of a tensor group compute them."""
    v = logits_TV.shape[1]
    out: dict[str, list[torch.Tensor]] = {"logp": [], "h": [], "dlogp": [], "dh": []}
    for parts in (1, 2, 3, 4):
        bounds = [vocab_slice(v, parts, r) for r in range(parts)]
        shards = [logits_TV[:, a:b] for a, b in bounds]
        m_T = torch.stack([shard_max(x, temp_T, CHUNK) for x in shards]).amax(0)  # all-reduce MAX
        lp_2T = sum(
            shard_logprob_partials(x, targets_T, a, temp_T, m_T, CHUNK)
            for x, (a, _) in zip(shards, bounds, strict=True)
        )
        ep_2T = sum(shard_entropy_partials(x, temp_T, m_T, CHUNK) for x in shards)
        assert isinstance(lp_2T, torch.Tensor)
        assert isinstance(ep_2T, torch.Tensor)
        logp_T, lse_T = logprobs_from_partials(m_T, lp_2T)
        h_T, lse2_T = entropy_from_partials(m_T, ep_2T)
        torch.testing.assert_close(lse2_T, lse_T, rtol=0, atol=1e-12)
        out["logp"].append(logp_T)
        out["h"].append(h_T)
        out["dlogp"].append(
            torch.cat(
                [
                    shard_logprob_grad(x, targets_T, a, temp_T, lse_T, grad_T, CHUNK)
                    for x, (a, _) in zip(shards, bounds, strict=True)
                ],
                dim=1,
            )
        )
        out["dh"].append(
            torch.cat([shard_entropy_grad(x, temp_T, lse_T, h_T, grad_T, CHUNK) for x in shards], 1)
        )
    return out


def reference(
    logits_TV: torch.Tensor, targets_T: torch.Tensor, temp_T: torch.Tensor, grad_T: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The same from a float64 log_softmax of the whole vocabulary, gradients by autograd."""
    x = logits_TV.detach().double().requires_grad_()
    logq = torch.log_softmax(x / temp_T.double()[:, None], dim=-1)
    logp_T = logq.gather(-1, targets_T[:, None]).squeeze(-1)
    h_T = -(logq.exp() * logq).sum(-1)
    (dlogp,) = torch.autograd.grad((logp_T * grad_T).sum(), x, retain_graph=True)
    (dh,) = torch.autograd.grad((h_T * grad_T).sum(), x)
    return {"logp": logp_T.detach(), "h": h_T.detach(), "dlogp": dlogp, "dh": dh}


@pytest.mark.parametrize("vocab", [263, 5])
def test_slices_combine_into_the_full_softmax(vocab: int) -> None:
    gen = torch.Generator().manual_seed(0)
    t = 8
    logits_TV = 3.0 * torch.randn(t, vocab, generator=gen, dtype=torch.float64)
    targets_T = torch.randint(0, vocab, (t,), generator=gen)
    targets_T[:2] = torch.tensor([0, vocab - 1])  # the first and the last slice's edges
    temp_T = 0.5 + torch.rand(t, generator=gen, dtype=torch.float64)
    grad_T = torch.randn(t, generator=gen, dtype=torch.float64)

    expected = reference(logits_TV, targets_T, temp_T, grad_T)
    for name, values in simulated(logits_TV, targets_T, temp_T, grad_T).items():
        for got in values:
            torch.testing.assert_close(got, expected[name], rtol=0, atol=1e-12)


def test_float32_slices_agree_with_the_unsplit_kernels() -> None:
    gen = torch.Generator().manual_seed(1)
    t, vocab = 6, 263
    logits_TV = torch.randn(t, vocab, generator=gen)
    targets_T = torch.randint(0, vocab, (t,), generator=gen)
    temp_T = torch.full((t,), 0.7)
    got = simulated(logits_TV, targets_T, temp_T, torch.ones(t))
    logp = token_logprobs(logits_TV[None], targets_T[None], 0.7)[0]
    h = token_entropy(logits_TV[None], 0.7)[0]
    for two_slices in (got["logp"][1], got["h"][1]):
        assert two_slices.dtype == torch.float32
    torch.testing.assert_close(got["logp"][1], logp, rtol=0, atol=1e-6)
    torch.testing.assert_close(got["h"][1], h, rtol=0, atol=1e-6)


@pytest.mark.parametrize(("size", "parts"), [(263, 2), (263, 3), (263, 4), (5, 4), (3, 5)])
def test_vocab_slices_follow_dtensors_shard_layout(size: int, parts: int) -> None:
    # DTensor's Shard cuts a dimension as torch.chunk does, padding with empty slices
    chunks = [len(c) for c in torch.chunk(torch.arange(size), parts)]
    chunks += [0] * (parts - len(chunks))
    bounds = [vocab_slice(size, parts, r) for r in range(parts)]
    assert [b - a for a, b in bounds] == chunks
    assert [a for a, _ in bounds] == [sum(chunks[:r]) for r in range(parts)]
