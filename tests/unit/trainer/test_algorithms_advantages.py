"""Advantage functions against independent float64 references written as plain Python loops."""

from __future__ import annotations

import random
import statistics

import pytest
import torch

from trainer.algorithms import (
    discounted_returns,
    gae,
    group_advantages,
    normalize,
    reinforce_pp_advantages,
    rewards_at_turn_ends,
    turn_values_to_tokens,
)

F64 = torch.float64
EPS = 1e-5

REWARDS = [1.0, 0.0, 0.5, 3.0, -1.0, 2.0, 0.0, 4.0, 7.0, 1.0]
IDS: list[str | None] = ["a", "b", "a", None, "c", "b", "a", "c", "solo", None]


def ref_group(rewards: list[float], ids: list[str | None], mode: str) -> list[float]:
    out = []
    for i, r in enumerate(rewards):
        g = ids[i]
        members = [i] if g is None else [j for j, h in enumerate(ids) if h == g]
        vals = [rewards[j] for j in members]
        n = len(vals)
        if mode == "none":
            out.append(r)
        elif n == 1:
            out.append(0.0)
        elif mode == "mean":
            out.append(r - statistics.fmean(vals))
        elif mode == "mean_std":
            out.append((r - statistics.fmean(vals)) / (statistics.stdev(vals) + EPS))
        else:
            out.append(r - (sum(vals) - r) / (n - 1))
    return out


@pytest.mark.parametrize("mode", ["mean", "mean_std", "leave_one_out", "none"])
def test_group_advantages_match_loop_and_ignore_row_order(mode: str) -> None:
    rng = random.Random(0)
    for _ in range(3):
        order = list(range(len(REWARDS)))
        rng.shuffle(order)
        rewards = [REWARDS[i] for i in order]
        ids = [IDS[i] for i in order]
        got = group_advantages(torch.tensor(rewards, dtype=F64), ids, mode)  # type: ignore[arg-type]
        assert got.tolist() == pytest.approx(ref_group(rewards, ids, mode), abs=1e-12)


def test_group_advantages_by_hand() -> None:
    r = torch.tensor([1.0, 0.0, 0.0, 2.0, 5.0], dtype=F64)
    ids: list[str | None] = ["g", "h", "g", "g", None]
    # group g = {1, 0, 2}: mean 1, unbiased std 1; h and None are singletons -> 0
    assert group_advantages(r, ids, "mean").tolist() == pytest.approx([0, 0, -1, 1, 0])
    std = group_advantages(r, ids, "mean_std", eps=1e-12)
    assert std.tolist() == pytest.approx([0, 0, -1, 1, 0])
    with pytest.raises(ValueError, match="eps must be > 0"):
        group_advantages(r, ids, "mean_std", eps=0.0)
    # leave one out: 1 - (0+2)/2 = 0, 0 - 3/2, 2 - 1/2
    assert group_advantages(r, ids, "leave_one_out").tolist() == pytest.approx([0, 0, -1.5, 1.5, 0])


def test_uniform_group_gets_zero_advantage_not_nan() -> None:
    r = torch.tensor([1.0, 1.0, 1.0], dtype=F64)
    out = group_advantages(r, ["x", "x", "x"], "mean_std")
    assert out.tolist() == [0.0, 0.0, 0.0]


def test_group_advantages_reject_mismatched_ids() -> None:
    with pytest.raises(ValueError, match="one reward and one group id"):
        group_advantages(torch.zeros(3), ["a", "b"], "mean")


def test_normalize_matches_masked_loop() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 6, generator=gen, dtype=F64) * 3 + 1
    mask = torch.rand(3, 6, generator=gen) > 0.4
    x[~mask] = 1e6  # must not leak into the statistics
    got = normalize(x, mask, eps=EPS)
    vals = [x[b, t].item() for b in range(3) for t in range(6) if mask[b, t]]
    mu, sd = statistics.fmean(vals), statistics.stdev(vals)
    for b in range(3):
        for t in range(6):
            want = (x[b, t].item() - mu) / (sd + EPS) if mask[b, t] else 0.0
            assert got[b, t].item() == pytest.approx(want, abs=1e-12)


def test_normalize_degenerate_masks() -> None:
    x = torch.tensor([[3.0, 4.0]], dtype=F64)
    assert normalize(x, torch.tensor([[0, 0]])).tolist() == [[0.0, 0.0]]
    assert normalize(x, torch.tensor([[1, 0]])).tolist() == [[0.0, 0.0]]


def test_turn_values_broadcast_over_spans() -> None:
    out = turn_values_to_tokens(torch.tensor([2.0, -1.0], dtype=F64), [(2, 4), (6, 7)], 8)
    assert out.tolist() == [0, 0, 2, 2, 0, 0, -1, 0]
    with pytest.raises(ValueError, match="turn_spans"):
        turn_values_to_tokens(torch.tensor([1.0, 1.0]), [(3, 5), (4, 6)], 8)
    with pytest.raises(ValueError, match="turn_spans"):
        turn_values_to_tokens(torch.tensor([1.0]), [(3, 9)], 8)


def test_rewards_at_turn_ends() -> None:
    spans = [(1, 3), (4, 4), (5, 7)]  # the middle turn sampled nothing
    out = rewards_at_turn_ends(torch.tensor([1.0, 10.0, 100.0], dtype=F64), spans, 8)
    assert out.tolist() == [0, 0, 11, 0, 0, 0, 100, 0]


def ref_gae(
    r: list[float], v: list[float], m: list[int], gamma: float, lam: float
) -> tuple[list[float], list[float]]:
    adv = [0.0] * len(r)
    ret = [0.0] * len(r)
    next_v = next_a = 0.0
    for t in reversed([t for t in range(len(r)) if m[t]]):
        delta = r[t] + gamma * next_v - v[t]
        a = delta + gamma * lam * next_a
        adv[t], ret[t] = a, a + v[t]
        next_v, next_a = v[t], a
    return adv, ret


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.9, 0.8), (0.99, 0.0)])
def test_gae_matches_backward_loop_over_sampled_tokens(gamma: float, lam: float) -> None:
    gen = torch.Generator().manual_seed(2)
    B, T = 3, 9
    r = torch.randn(B, T, generator=gen, dtype=F64)  # rewards at masked positions are ignored
    v = torch.randn(B, T, generator=gen, dtype=F64)
    mask = (torch.rand(B, T, generator=gen) > 0.35).long()
    mask[2] = 0  # a row with nothing sampled
    adv, ret = gae(r, v, mask, gamma, lam)
    for b in range(B):
        want_adv, want_ret = ref_gae(r[b].tolist(), v[b].tolist(), mask[b].tolist(), gamma, lam)
        assert adv[b].tolist() == pytest.approx(want_adv, abs=1e-12)
        assert ret[b].tolist() == pytest.approx(want_ret, abs=1e-12)


def test_discounted_returns_skip_tool_tokens() -> None:
    # two turns [1,3) and [5,7) with tool tokens between; reward 1 after turn one, 2 at the end
    spans = [(1, 3), (5, 7)]
    rewards = rewards_at_turn_ends(torch.tensor([1.0, 2.0], dtype=F64), spans, 8)[None]
    mask = turn_values_to_tokens(torch.ones(2, dtype=F64), spans, 8)[None]
    # sampled chain t1, t2 (+1), t5, t6 (+2); the discount counts sampled tokens only:
    # A6 = 2, A5 = 0.5 * 2, A2 = 1 + 0.5 * A5, A1 = 0.5 * A2
    got = discounted_returns(rewards, mask, 0.5)[0].tolist()
    assert got == pytest.approx([0, 0.75, 1.5, 0, 0, 1.0, 2.0, 0], abs=1e-12)
    # gamma = 1: per-turn returns broadcast over the turn, as the store computes them
    got1 = discounted_returns(rewards, mask, 1.0)[0]
    turn_returns = torch.tensor([3.0, 2.0], dtype=F64)
    assert torch.equal(got1, turn_values_to_tokens(turn_returns, spans, 8))


def test_reinforce_pp_is_global_normalisation_of_return_minus_baseline() -> None:
    ret = torch.tensor([[0.0, 2.0, 2.0, 0.0], [9.0, 0.0, -1.0, -1.0]], dtype=F64)
    base = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]], dtype=F64)
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1]])
    for baseline in (None, base):
        got = reinforce_pp_advantages(ret, mask, baseline, eps=EPS)
        x = ret if baseline is None else ret - base
        cells = [(b, t) for b in range(2) for t in range(4) if mask[b, t]]
        vals = [x[b, t].item() for b, t in cells]
        mu, sd = statistics.fmean(vals), statistics.stdev(vals)
        for b in range(2):
            for t in range(4):
                want = (x[b, t].item() - mu) / (sd + EPS) if (b, t) in cells else 0.0
                assert got[b, t].item() == pytest.approx(want, abs=1e-12)
