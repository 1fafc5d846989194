"""The loss terms beside the policy loss, against independent float64 references written as plain
Python loops: KL estimators, the logprob mismatch, entropy, the value loss, explained variance."""

from __future__ import annotations

import math

import pytest
import torch

from tests.support.losses import AGGS, F64, NORM_LEN, VARIANTS, batch, run_loss
from trainer.algorithms import (
    aggregate,
    entropy_from_logits,
    explained_variance,
    kl_penalty,
    value_loss,
)
from trainer.algorithms.losses import logprob_mismatch


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_estimators_match_loop(kind: str) -> None:
    gen = torch.Generator().manual_seed(10)
    logp = -torch.rand(4, 7, generator=gen, dtype=F64) * 4
    ref = -torch.rand(4, 7, generator=gen, dtype=F64) * 4
    got = kl_penalty(logp, ref, kind)  # type: ignore[arg-type]
    for b in range(4):
        for t in range(7):
            d = logp[b, t].item() - ref[b, t].item()
            want = {"k1": d, "k2": d * d / 2, "k3": math.exp(-d) - 1 + d}[kind]
            assert got[b, t].item() == pytest.approx(max(-10.0, min(10.0, want)), abs=1e-12)
    if kind != "k1":
        assert bool((got >= 0).all())


def test_k3_is_nonnegative_and_clamped() -> None:
    d = torch.linspace(-20, 20, 401, dtype=F64)
    k3 = kl_penalty(d, torch.zeros_like(d), "k3")
    assert bool((k3 >= 0).all())
    assert k3.max().item() == 10.0
    assert kl_penalty(torch.zeros(1, dtype=F64), torch.zeros(1, dtype=F64), "k3").item() == 0.0


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_gradient_is_finite_and_zero_past_the_clamp(kind: str) -> None:
    d = [200.0, -200.0, 0.5, -0.5]  # k3 at -200 overflows float32: exp(200) = inf
    logp = torch.tensor([d], dtype=torch.float32, requires_grad=True)
    kl = kl_penalty(logp, torch.zeros_like(logp), kind)  # type: ignore[arg-type]
    k3 = [math.exp(-x) - 1 + x for x in d[2:]]
    want = {"k1": [10.0, -10.0, 0.5, -0.5], "k2": [10.0, 10.0, 0.125, 0.125]}.get(kind)
    assert kl[0].tolist() == pytest.approx(want or [10.0, 10.0, *k3], abs=1e-6)
    kl.sum().backward()
    assert logp.grad is not None
    slope = {"k1": lambda x: 1.0, "k2": lambda x: x, "k3": lambda x: 1 - math.exp(-x)}[kind]
    assert logp.grad[0].tolist() == pytest.approx([0.0, 0.0, slope(0.5), slope(-0.5)], abs=1e-6)


def test_kl_as_a_loss_term_pulls_towards_the_reference() -> None:
    logp = torch.tensor([[-1.0, -2.0]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]], dtype=F64)
    loss = 0.1 * aggregate(kl_penalty(logp, ref, "k3"), torch.ones(1, 2), "token_mean")
    loss.backward()
    assert logp.grad is not None
    # d/dlogp of exp(ref - logp) - 1 + logp - ref is 1 - exp(ref - logp)
    want = [0.1 / 2 * (1 - math.exp(r - lp)) for lp, r in ((-1.0, -1.5), (-2.0, -1.0))]
    assert logp.grad[0].tolist() == pytest.approx(want)


def test_logprob_mismatch_matches_loop() -> None:
    d = batch(15)
    trainer, behav, m = d["old"].float(), d["behav"].float(), d["mask"]
    trainer[0, 1] = behav[0, 1] + 100.0  # exp(100) overflows float32, not the float64 metric
    behav[~m] = -math.inf  # positions off the mask are never read
    got = logprob_mismatch(trainer, behav, m)
    deltas = [
        float(trainer[b, t]) - float(behav[b, t])
        for b in range(m.shape[0])
        for t in range(m.shape[1])
        if m[b, t]
    ]
    assert got["mismatch_abs_mean"].item() == pytest.approx(
        sum(abs(x) for x in deltas) / len(deltas), rel=1e-12
    )
    assert got["mismatch_abs_max"].item() == pytest.approx(max(abs(x) for x in deltas), rel=1e-12)
    want_kl = sum(math.exp(x) - 1 - x for x in deltas) / len(deltas)
    assert got["mismatch_kl"].item() == pytest.approx(want_kl, rel=1e-12)
    assert got["mismatch_abs_max"].item() == pytest.approx(100.0, abs=1e-4)
    empty = logprob_mismatch(trainer, behav, torch.zeros_like(m))
    assert {k: v.item() for k, v in empty.items()} == dict.fromkeys(got, 0.0)
    same = logprob_mismatch(trainer, trainer, m)
    assert {k: v.item() for k, v in same.items()} == dict.fromkeys(got, 0.0)


def test_entropy_matches_loop_and_is_stable() -> None:
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(2, 3, 5, generator=gen, dtype=F64) * 4
    got = entropy_from_logits(logits)
    for b in range(2):
        for t in range(3):
            z = logits[b, t].tolist()
            top = max(z)
            s = sum(math.exp(x - top) for x in z)
            ps = [math.exp(x - top) / s for x in z]
            want = -sum(p * math.log(p) for p in ps)
            assert got[b, t].item() == pytest.approx(want, abs=1e-12)
    huge = torch.tensor([[[1e4, 0.0, -1e4], [3e4, 3e4, 3e4]]], dtype=torch.bfloat16)
    h = entropy_from_logits(huge)
    assert h.dtype == torch.float32
    assert h[0, 0].item() == pytest.approx(0.0, abs=1e-6)
    assert h[0, 1].item() == pytest.approx(math.log(3), abs=1e-6)


@pytest.mark.parametrize("clip", [None, 0.2])
@pytest.mark.parametrize("agg", AGGS)
def test_value_loss_matches_loop(clip: float | None, agg: str) -> None:
    d = batch(12)
    old = d["old"]
    values = old + 0.3 * torch.randn(
        old.shape, generator=torch.Generator().manual_seed(1), dtype=F64
    )
    returns = d["adv"]
    m = d["mask"]
    loss, s = value_loss(values, old, returns, m, value_clip=clip, agg=agg, norm_len=NORM_LEN)  # type: ignore[arg-type]
    per_tok: dict[tuple[int, int], float] = {}
    n_clipped = 0
    for b in range(values.shape[0]):
        for t in range(values.shape[1]):
            if not m[b, t]:
                continue
            v, vo, r = values[b, t].item(), old[b, t].item(), returns[b, t].item()
            l1 = 0.5 * (v - r) ** 2
            if clip is not None:
                l2 = 0.5 * (vo + min(max(v - vo, -clip), clip) - r) ** 2
                n_clipped += l2 > l1
                l1 = max(l1, l2)
            per_tok[b, t] = l1
    rows = [[per_tok[b, t] for t in range(6) if (b, t) in per_tok] for b in range(3)]
    rows = [r for r in rows if r]
    want = {
        "token_mean": sum(per_tok.values()) / len(per_tok),
        "token_sum": sum(per_tok.values()),
        "seq_mean_token_mean": sum(sum(r) / len(r) for r in rows) / len(rows),
        "seq_mean_token_sum": sum(sum(r) / NORM_LEN for r in rows) / len(rows),
    }[agg]
    assert loss.item() == pytest.approx(want, abs=1e-12)
    assert s["value_clip_frac"].item() == pytest.approx(n_clipped / len(per_tok))
    if clip is not None:
        assert n_clipped > 0


def test_empty_mask_gives_zero_loss_and_finite_stats() -> None:
    d = batch(13)
    d["mask"] = torch.zeros_like(d["mask"])
    for variant in VARIANTS.values():
        for agg in AGGS:
            loss, stats = run_loss(d, variant, agg)
            assert loss.item() == 0.0
            assert all(math.isfinite(v.item()) for v in stats.values())


def test_explained_variance_matches_loop() -> None:
    d = batch(21)
    returns, m = d["adv"], d["mask"]
    values = returns + 0.5 * torch.randn(
        returns.shape, generator=torch.Generator().manual_seed(3), dtype=F64
    )
    pairs = [
        (values[b, t].item(), returns[b, t].item())
        for b in range(returns.shape[0])
        for t in range(returns.shape[1])
        if m[b, t]
    ]
    n = len(pairs)
    r_mean = sum(r for _, r in pairs) / n
    var_r = sum((r - r_mean) ** 2 for _, r in pairs) / n
    d_mean = sum(r - v for v, r in pairs) / n
    var_d = sum((r - v - d_mean) ** 2 for v, r in pairs) / n
    got = explained_variance(values, returns, m)
    assert got.item() == pytest.approx(1 - var_d / var_r, abs=1e-12)
    assert 0 < got.item() < 1  # a noisy but informative critic
    # a perfect critic explains everything; a constant one nothing; constant returns give 0
    assert explained_variance(returns, returns, m).item() == pytest.approx(1.0)
    assert explained_variance(torch.full_like(returns, 3.0), returns, m).item() == pytest.approx(
        0.0, abs=1e-12
    )
    assert explained_variance(values, torch.ones_like(returns), m).item() == 0.0
    assert explained_variance(values, returns, torch.zeros_like(m)).item() == 0.0
