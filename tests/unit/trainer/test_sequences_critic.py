"""The critic's side of forming a batch: token rewards from the store's per-turn returns, GAE over
each sequence's sampled tokens with the critic's values, and packing of values and returns, each
checked against a plain float64 loop."""

from __future__ import annotations

import random

import pytest
import torch

from trainer.algorithms import algorithm_config
from trainer.batch import TrainSequence, pack
from trainer.sequences import critic_token_rewards, with_gae


def test_token_rewards_sit_on_turn_ends_and_the_last_turn_carries_the_tail() -> None:
    # turns sampled at [2, 4) and [6, 9); G_1 = 0.5 + 0.9 * G_2, G_2 = 2.0 (incl. later segments)
    returns = [0.5 + 0.9 * 2.0, 2.0]
    got = critic_token_rewards(returns, [(2, 4), (6, 9)], 10, discount=0.9).tolist()
    assert got == pytest.approx([0, 0, 0, 0.5, 0, 0, 0, 0, 2.0, 0])
    # one final reward, gamma 1: every turn's own reward is 0 but the last
    got = critic_token_rewards([1.0, 1.0, 1.0], [(1, 2), (3, 5), (6, 7)], 7, 1.0).tolist()
    assert got == [0, 0, 0, 0, 0, 0, 1.0]


def ref_gae(r: list[float], v: list[float], m: list[int], gamma: float, lam: float) -> list[float]:
    """A_t over sampled tokens only, walking backwards; no bootstrap after the last one."""
    adv = [0.0] * len(r)
    next_v = next_a = 0.0
    for t in reversed(range(len(r))):
        if not m[t]:
            continue
        delta = r[t] + gamma * next_v - v[t]
        adv[t] = delta + gamma * lam * next_a
        next_v, next_a = v[t], adv[t]
    return adv


def seqs_and_inputs(seed: int) -> tuple[list[TrainSequence], list[list[float]], list[list[float]]]:
    rng = random.Random(seed)
    seqs, rewards, values = [], [], []
    for n in (9, 4, 13, 6):
        mask = [0] + [int(rng.random() < 0.7) for _ in range(n - 1)]
        mask[-1] = 1
        seqs.append(
            TrainSequence(
                tokens=[rng.randrange(256) for _ in range(n)],
                loss_mask=mask,
                behav_logprobs=[-1.0 * x for x in mask],
                advantages=[0.0] * n,
                versions=[0 if x else -1 for x in mask],
            )
        )
        rewards.append([rng.gauss(0, 1) * x for x in mask])
        values.append([rng.gauss(0, 1) for _ in range(n)])  # junk off the mask must not matter
    return seqs, rewards, values


@pytest.mark.parametrize(("gamma", "lam", "norm"), [(1.0, 1.0, "none"), (0.9, 0.8, "batch")])
def test_with_gae_matches_loop(gamma: float, lam: float, norm: str) -> None:
    seqs, rewards, values = seqs_and_inputs(seed=4)
    algo = algorithm_config("ppo", lam=lam, adv_norm=norm)
    # a discount on every token: gae's per-token factors (a per-turn discount sets them per turn)
    out = with_gae(seqs, rewards, values, algo, discounts=[[gamma] * len(s) for s in seqs])
    advs = [
        ref_gae(r, v, s.loss_mask, gamma, lam)
        for s, r, v in zip(seqs, rewards, values, strict=True)
    ]
    flat = [
        a
        for s, adv in zip(seqs, advs, strict=True)
        for a, m in zip(adv, s.loss_mask, strict=True)
        if m
    ]
    mean = sum(flat) / len(flat)
    std = (sum((a - mean) ** 2 for a in flat) / (len(flat) - 1)) ** 0.5
    for s, o, adv, v in zip(seqs, out, advs, values, strict=True):
        assert o.tokens == s.tokens
        for t, m in enumerate(s.loss_mask):
            want_adv = ((adv[t] - mean) / (std + 1e-5) if norm == "batch" else adv[t]) if m else 0
            assert o.advantages[t] == pytest.approx(want_adv, abs=1e-12)
            assert o.values is not None
            assert o.returns is not None
            assert o.values[t] == (v[t] if m else 0.0)
            assert o.returns[t] == pytest.approx(adv[t] + v[t] if m else 0.0, abs=1e-12)


def test_values_and_returns_pack_shifted_like_every_other_token_value() -> None:
    seqs, rewards, values = seqs_and_inputs(seed=5)
    out = with_gae(seqs, rewards, values, algorithm_config("ppo"))
    (mb,) = pack(out, 1000)
    assert mb.old_values_1T is not None
    assert mb.returns_1T is not None
    start = 0
    for j, n in zip(mb.seq_ids, mb.seq_lens, strict=True):
        s = out[j]
        assert s.values is not None
        assert s.returns is not None
        want_v = torch.tensor([*s.values[1:], 0.0], dtype=torch.float32)
        want_r = torch.tensor([*s.returns[1:], 0.0], dtype=torch.float32)
        assert torch.equal(mb.old_values_1T[0, start : start + n], want_v)
        assert torch.equal(mb.returns_1T[0, start : start + n], want_r)
        start += n
    assert pack(seqs, 1000)[0].returns_1T is None  # no critic: nothing packed
