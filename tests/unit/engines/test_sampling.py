"""Sampling math against independent float64 references."""

from __future__ import annotations

import math

import pytest
import torch

from engines.sampling import behaviour_logprobs, draw, sample, truncate


def _ref_keep(probs: list[float], k: int, p: float) -> set[int]:
    """The kept set, by a plain loop: top-k first, then the smallest prefix reaching mass p."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    if k > 0:
        order = order[:k]
    kept, mass = set(), 0.0
    for i in order:
        kept.add(i)
        mass += probs[i]
        if p < 1.0 and mass >= p:
            break
    return kept


def test_behaviour_logprobs_match_float64_reference() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3
    temps = torch.tensor([0.0, 0.5, 1.0, 1.7])
    got = behaviour_logprobs(logits, temps)
    for b, t in enumerate(temps.tolist()):
        scaled = logits[b].double() / (t if t > 0 else 1.0)
        ref = scaled - torch.logsumexp(scaled, dim=-1)
        assert torch.allclose(got[b].double(), ref, atol=1e-5)


@pytest.mark.parametrize(("k", "p"), [(0, 1.0), (5, 1.0), (0, 0.5), (3, 0.9), (0, 0.999), (1, 1.0)])
def test_truncate_keeps_exactly_the_reference_set(k: int, p: float) -> None:
    torch.manual_seed(k * 10 + int(p * 100))
    logp = torch.log_softmax(torch.randn(3, 40) * 2, dim=-1)
    out = truncate(logp, torch.tensor([k] * 3), torch.tensor([p] * 3))
    for b in range(3):
        kept = {i for i, v in enumerate(out[b].tolist()) if math.isfinite(v)}
        assert kept == _ref_keep(logp[b].exp().double().tolist(), k, p)
        # kept entries are untouched (not renormalised)
        assert torch.equal(out[b][list(kept)], logp[b][list(kept)])


def test_truncate_applies_per_row_settings() -> None:
    logp = torch.log_softmax(torch.tensor([[3.0, 2.0, 1.0, 0.0]] * 2), dim=-1)
    out = truncate(logp, torch.tensor([1, 0]), torch.tensor([1.0, 1.0]))
    assert torch.isfinite(out[0]).sum() == 1
    assert torch.isfinite(out[1]).all()


def test_greedy_rows_take_the_argmax_and_seeded_rows_are_reproducible() -> None:
    torch.manual_seed(1)
    logp = torch.log_softmax(torch.randn(3, 30), dim=-1)

    def draw() -> list[int]:
        gens = [None, torch.Generator().manual_seed(7), torch.Generator().manual_seed(8)]
        return sample(logp, greedy_B=[True, False, False], generators=gens).tolist()

    first = draw()
    assert first[0] == int(logp[0].argmax())
    assert draw() == first


@pytest.mark.parametrize("seeded", [True, False], ids=["own-generator", "shared-generator"])
def test_sampling_follows_the_distribution(seeded: bool) -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 4000
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(4)
    if seeded:
        logp = probs.log()[None]
        for _ in range(n):
            counts[sample(logp, greedy_B=[False], generators=[gen])[0]] += 1
    else:  # unseeded rows are drawn in one batched call
        logp = probs.log()[None].expand(n, 4)
        out = sample(logp, greedy_B=[False] * n, generators=[None] * n, shared=gen)
        counts = torch.bincount(out, minlength=4).float()
    # 4-sigma binomial bounds on every bucket
    sigma = (probs * (1 - probs) / n).sqrt()
    assert ((counts / n - probs).abs() <= 4 * sigma).all(), counts / n


def test_a_zero_probability_token_is_never_drawn() -> None:
    # truncated (top-k/top-p) tokens have probability 0, between and beside kept ones
    probs = torch.tensor([0.0, 0.5, 0.0, 0.0, 0.3, 0.2, 0.0])
    n = 20000
    gen = torch.Generator().manual_seed(3)
    out = draw(probs[None].expand(n, -1), gen)
    counts = torch.bincount(out, minlength=7).float() / n
    assert counts[probs == 0].sum() == 0, counts
    sigma = (probs * (1 - probs) / n).sqrt()
    assert ((counts - probs).abs() <= 4 * sigma).all(), counts
    one = torch.zeros(1, 49152)
    one[0, 49151] = 1e-30  # a tiny share at the vocabulary's end is still the only choice
    assert draw(one, gen).tolist() == [49151]
