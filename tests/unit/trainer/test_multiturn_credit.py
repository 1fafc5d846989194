"""Multi-turn credit assignment: each turn's return against its turn position in the group, the
per-turn discount in GAE and the KL reward-to-go, checked against float64 loops and against the
failure they replace (a uniform group's later turns got advantages of 9,000 and 19,000); a cut
turn's reward taken by `zero_truncated_reward`."""

from __future__ import annotations

import math
import random
from collections import defaultdict

import pytest
import torch

from store.trajectories import discounted_returns
from store.types import Reward, Trajectory
from tests.support.knobs import claimed_session
from trainer.algorithms.advantages import (
    gae,
    normalize,
    rewards_at_turn_ends,
    turn_discounts,
    turn_group_advantages,
)
from trainer.sequences import truncated_turns_unrewarded

F64 = torch.float64


def loop_advantages(
    returns: list[list[float]], groups: list[str], mode: str, eps: float = 1e-5
) -> list[list[float]]:
    """Per trajectory and turn: the return against the returns at that turn of the group's
    trajectories that reached it (a float64 loop, independent of the implementation)."""
    at: dict[tuple[str, int], list[float]] = defaultdict(list)
    for g, rs in zip(groups, returns, strict=True):
        for p, r in enumerate(rs):
            at[(g, p)].append(r)
    out = []
    for g, rs in zip(groups, returns, strict=True):
        row = []
        for p, r in enumerate(rs):
            peers = at[(g, p)]
            n = len(peers)
            if mode == "none":
                row.append(r)
            elif n == 1:
                row.append(0.0)
            elif mode == "mean":
                row.append(r - sum(peers) / n)
            elif mode == "leave_one_out":
                row.append(r - (sum(peers) - r) / (n - 1))
            else:
                mean = sum(peers) / n
                std = math.sqrt(sum((x - mean) ** 2 for x in peers) / (n - 1))
                row.append((r - mean) / (std + eps))
        out.append(row)
    return out


def returns_of(turn_rewards: list[float], final: float, discount: float) -> list[float]:
    """The store's discounted returns of one episode."""
    ids = [f"t{k}" for k in range(len(turn_rewards))]
    rewards = [Reward(r, cid, None, None) for r, cid in zip(turn_rewards, ids, strict=True)]  # type: ignore[arg-type]
    rewards.append(Reward(final, None, None, None))  # type: ignore[arg-type]
    return list(discounted_returns(ids, rewards, discount).values())


def flat(returns: list[list[float]], groups: list[str], mode: str) -> list[list[float]]:
    rows = [(g, p, r) for g, rs in zip(groups, returns, strict=True) for p, r in enumerate(rs)]
    adv = turn_group_advantages(
        torch.tensor([r for *_, r in rows], dtype=F64),
        [g for g, _, _ in rows],
        [p for _, p, _ in rows],
        mode,  # type: ignore[arg-type]
    ).tolist()
    out, k = [], 0
    for rs in returns:
        out.append(adv[k : k + len(rs)])
        k += len(rs)
    return out


@pytest.mark.parametrize("mode", ["mean_std", "mean", "leave_one_out", "none"])
@pytest.mark.parametrize("discount", [1.0, 0.9])
def test_turn_advantages_match_the_loop(mode: str, discount: float) -> None:
    rng = random.Random(7)
    groups, returns = [], []
    for g in range(5):
        for _ in range(rng.randint(1, 4)):
            turns = rng.randint(1, 4)
            per_turn = [rng.choice([0.0, 0.0, 0.5, 1.0]) for _ in range(turns)]
            returns.append(returns_of(per_turn, rng.choice([0.0, 1.0]), discount))
            groups.append(f"g{g}")
    got = flat(returns, groups, mode)
    want = loop_advantages(returns, groups, mode)
    for a, b in zip(got, want, strict=True):
        assert a == pytest.approx(b, abs=1e-12)


def test_a_uniform_group_gets_zero_at_every_turn_not_one_over_eps() -> None:
    """The measured failure: three turns, discount 0.9, final reward 1 for every member."""
    returns = [returns_of([0.0, 0.0, 0.0], 1.0, 0.9)] * 4
    got = flat(returns, ["u"] * 4, "mean_std")
    assert got == [[0.0, 0.0, 0.0]] * 4


def test_a_mixed_groups_winners_and_losers_keep_their_sign_beside_a_uniform_group() -> None:
    """After batch normalisation a uniform group no longer dominates: in the mixed group the
    winners' turns are above every loser's turn (they got the same -0.64 before)."""
    returns = [returns_of([0.0, 0.0, 0.0], 1.0, 0.9)] * 4  # uniform
    returns += [returns_of([0.0, 0.0, 0.0], r, 0.9) for r in (1.0, 1.0, 0.0, 0.0)]  # mixed
    groups = ["u"] * 4 + ["m"] * 4
    adv = flat(returns, groups, "mean_std")
    tokens = torch.tensor([[a for row in adv for a in row]], dtype=F64)
    normed = normalize(tokens, torch.ones_like(tokens, dtype=torch.bool))[0].tolist()
    mixed = normed[12:]
    winners, losers = mixed[:6], mixed[6:]
    assert min(winners) > 0 > max(losers)
    assert max(abs(x) for x in normed) < 3


def test_per_turn_rewards_do_not_push_a_perfect_episodes_later_turns_down() -> None:
    """discount 1 and a reward per turn: a perfect episode's every turn is above (or level with)
    the imperfect one's at the same turn, never below it."""
    perfect = returns_of([1.0, 1.0, 1.0], 0.0, 1.0)
    flawed = returns_of([1.0, 0.0, 0.0], 0.0, 1.0)
    adv = flat([perfect, flawed], ["g", "g"], "mean_std")
    assert all(a >= b for a, b in zip(adv[0], adv[1], strict=True))
    assert all(a >= 0 for a in adv[0])


def test_a_single_turn_group_is_grpo_on_the_episode() -> None:
    rewards = [1.0, 0.0, 0.5, 0.2]
    adv = flat([[r] for r in rewards], ["g"] * 4, "mean_std")
    mean = sum(rewards) / 4
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / 3)
    assert [a for (a,) in adv] == pytest.approx([(r - mean) / (std + 1e-5) for r in rewards])


def test_turn_discounts_count_the_turns_between_sampled_tokens() -> None:
    # turns [2, 5), [7, 9), an empty turn, [11, 13)
    g = turn_discounts([(2, 5), (7, 9), (9, 9), (11, 13)], 14, 0.5).tolist()
    want = [1.0] * 14
    want[4] = 0.5  # turn 0 -> turn 1
    want[8] = 0.25  # turn 1 -> turn 3, across the empty turn
    assert g == want


def test_gae_with_a_per_turn_discount_gives_each_turn_its_return() -> None:
    """V = 0 and lambda 1: GAE over per-turn token rewards, discounted per turn, gives every token
    of turn j the store's discounted return G_j."""
    spans = [(1, 3), (5, 8), (9, 10)]
    per_turn = [0.2, 0.0, 1.0]
    discount = 0.9
    g = [0.0] * 4
    for j in reversed(range(3)):
        g[j] = per_turn[j] + discount * g[j + 1]
    r_T = rewards_at_turn_ends(torch.tensor(per_turn, dtype=F64), spans, 10, discount)
    mask = torch.zeros(10, dtype=torch.bool)
    for a, b in spans:
        mask[a:b] = True
    adv, _ = gae(
        r_T[None],
        torch.zeros(1, 10, dtype=F64),
        mask[None],
        turn_discounts(spans, 10, discount)[None],
        1.0,
    )
    for j, (a, b) in enumerate(spans):
        assert adv[0, a:b].tolist() == pytest.approx([g[j]] * (b - a), abs=1e-12)


def test_a_reward_of_a_turn_without_tokens_is_discounted_onto_the_turn_before() -> None:
    r = rewards_at_turn_ends(torch.tensor([0.0, 1.0], dtype=F64), [(1, 3), (3, 3)], 4, 0.5)
    assert r.tolist() == [0.0, 0.0, 0.5, 0.0]


def _trajectory(finish: dict[str, str], per_turn: dict[str, float] | None) -> Trajectory:
    info = claimed_session("sess-cut", None)
    returns = {"a": 1.5, "b": 1.0}  # r = (1.0, 1.0) at discount 0.5
    return Trajectory(info, [], returns, 2.0, 0, turn_rewards=per_turn or {}, finish_reasons=finish)


def test_zero_truncated_reward_takes_a_cut_turns_reward_or_refuses_without_it() -> None:
    whole = _trajectory({"a": "stop", "b": "stop"}, None)
    assert truncated_turns_unrewarded(whole, 0.5) is whole  # nothing cut: as it was
    cut = truncated_turns_unrewarded(
        _trajectory({"a": "length", "b": "stop"}, {"a": 1.0, "b": 1.0}), 0.5
    )
    assert (cut.returns, cut.reward) == ({"a": 0.5, "b": 1.0}, 1.0)
    # a hand-built trajectory without its turns' own rewards is refused, not trained wrong
    with pytest.raises(ValueError, match="sess-cut: zero_truncated_reward needs"):
        truncated_turns_unrewarded(_trajectory({"a": "length", "b": "stop"}, None), 0.5)
