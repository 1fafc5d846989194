"""The trajectory store's side of training, on a real SQLite file and a real PostgreSQL database
(each test runs on both): discounted returns, cut turns, and claims (leases, consume, release,
concurrent claimers getting disjoint sets that cover everything)."""

from __future__ import annotations

import asyncio
import time

import pytest

from store import (
    LeaseLostError,
    NotFoundError,
    Store,
)
from store.types import Outcome, TrainState
from tests.support.store_records import one_turn_session, rec
from trainer.algorithms.config import AlgorithmConfig
from trainer.sequences import build_sequences, truncated_turns_unrewarded


async def test_discounted_returns_match_a_hand_computed_example(store: Store) -> None:
    run = await store.create_run("returns", {})
    (new,) = await store.create_sessions(run.id, 1)
    sid = new.info.id
    await store.record_completions(
        [rec("g0", sid, 0, prompt=[1], prefix_len=0, output=[2], versions=[4], opens=True)]
    )
    await store.record_completions(
        [rec("g1", sid, 0, prompt=[1, 2, 3], prefix_len=2, output=[4, 5], versions=[5, 6])]
    )
    await store.record_completions(
        [rec("g2", sid, 1, prompt=[8], prefix_len=0, output=[9], versions=[6], opens=True)]
    )
    await store.add_reward(sid, 1.0, completion_id="g0")
    await store.add_reward(sid, 0.5, completion_id="g1")
    await store.add_reward(sid, -0.25, completion_id="g1")
    await store.add_reward(sid, 2.0)
    await store.add_reward(sid, 1.0, key="bonus")
    await store.end_session(sid)

    # r = [1.0, 0.25, 3.0] in turn order (g2 is last, so it takes the final 2.0 + 1.0).
    g2 = 3.0
    g1 = 0.25 + 0.9 * g2  # 2.95
    g0 = 1.0 + 0.9 * g1  # 3.655
    detail = await store.session_detail(sid, gamma=0.9)
    assert list(detail.returns) == ["g0", "g1", "g2"]
    assert detail.returns == pytest.approx({"g0": g0, "g1": g1, "g2": g2})
    assert (await store.session_detail(sid)).returns == pytest.approx(
        {"g0": 4.25, "g1": 3.25, "g2": 3.0}
    )
    (trajectory,) = await store.list_trainable(run.id, gamma=0.9)
    assert trajectory.returns == pytest.approx({"g0": g0, "g1": g1, "g2": g2})
    assert trajectory.reward == pytest.approx(4.25)
    assert trajectory.min_version == 4
    with pytest.raises(ValueError, match="gamma"):
        await store.session_detail(sid, gamma=1.1)


async def test_a_cut_turn_reaches_the_trainer_which_can_take_its_reward(store: Store) -> None:
    """The trajectory carries each turn's own reward and finish reason; under
    `zero_truncated_reward` the turn `max_tokens` cut (cut0, graded 1.0) earns nothing and the
    returns are discounted again without it."""
    run = await store.create_run("cut", {})
    (new,) = await store.create_sessions(run.id, 1)
    sid = new.info.id
    await store.record_completions(
        [
            rec(
                "cut0",
                sid,
                0,
                prompt=[1],
                prefix_len=0,
                output=[2, 3],
                opens=True,
                finish_reason="length",
            )
        ]
    )
    await store.record_completions(
        [rec("cut1", sid, 0, prompt=[1, 2, 3, 7], prefix_len=3, output=[8])]
    )
    await store.add_reward(sid, 1.0, completion_id="cut0")
    await store.add_reward(sid, 0.5)
    await store.end_session(sid)

    (t,) = await store.list_trainable(run.id, gamma=0.5)
    assert t.turn_rewards == {"cut0": 1.0, "cut1": 0.5}
    assert t.finish_reasons == {"cut0": "length", "cut1": "stop"}
    assert t.returns == pytest.approx({"cut0": 1.25, "cut1": 0.5})
    cut = truncated_turns_unrewarded(t, 0.5)
    assert cut.turn_rewards == {"cut0": 0.0, "cut1": 0.5}
    assert cut.returns == pytest.approx({"cut0": 0.25, "cut1": 0.5})
    assert (t.reward, cut.reward) == (1.5, 0.5)
    on = build_sequences([t], AlgorithmConfig(zero_truncated_reward=True), discount=0.5)
    off = build_sequences([t], AlgorithmConfig(), discount=0.5)
    assert (on.rewards, off.rewards, on.truncated_turns, off.truncated_turns) == (
        [0.5],
        [1.5],
        1,
        1,
    )


# the trainer's queue

LEASE = 2.0
"""Short enough to wait out, long enough for the few calls made while it must hold (0.4 s was
not, once, on a CI machine starved by the tests beside it)."""


async def sleep_until(deadline: float) -> None:
    await asyncio.sleep(max(0.0, deadline - time.monotonic()) + 0.05)


async def test_claims_lease_consume_and_release(store: Store) -> None:
    run = await store.create_run("queue", {})
    s1, s2, unrewarded, active = [await one_turn_session(store, run.id, f"q{i}") for i in range(4)]
    for sid in (s1, s2, active):
        await store.add_reward(sid, 1.0)
    for sid in (s1, s2, unrewarded):  # s1 ends first
        await store.end_session(sid)
    other_run = await store.create_run("other", {})
    elsewhere = await one_turn_session(store, other_run.id, "q-elsewhere")
    await store.add_reward(elsewhere, 1.0)
    await store.end_session(elsewhere)

    listed = await store.list_trainable(run.id)
    assert [t.session.id for t in listed] == [s1, s2]
    assert listed[0].segments[0].tokens == [1, 2]

    a_expires = time.monotonic() + LEASE
    (a,) = await store.claim(run.id, limit=1, owner="trainer-a", lease_seconds=LEASE)
    assert a.session.id == s1
    info = await store.get_session(s1)
    assert info.train_state is TrainState.CLAIMED
    assert [t.session.id for t in await store.list_trainable(run.id)] == [s2]
    b = await store.claim(run.id, limit=10, owner="trainer-b", lease_seconds=30)
    assert [t.session.id for t in b] == [s2]  # s1 is leased to a
    assert await store.claim(run.id, limit=10, owner="trainer-c", lease_seconds=30) == []

    await sleep_until(a_expires)  # a's lease expires; s1 is back in the queue
    assert [t.session.id for t in await store.list_trainable(run.id)] == [s1]
    (c,) = await store.claim(run.id, limit=10, owner="trainer-c", lease_seconds=30)
    assert c.session.id == s1

    with pytest.raises(LeaseLostError, match="trainer-a"):
        await store.mark_consumed([s1], owner="trainer-a", step=1)
    # All or nothing: s2 is b's, s1 is not, so neither is consumed.
    with pytest.raises(LeaseLostError, match=s1):
        await store.mark_consumed([s2, s1], owner="trainer-b", step=1)
    assert (await store.get_session(s2)).train_state is TrainState.CLAIMED
    with pytest.raises(NotFoundError):
        await store.mark_consumed(["sess_missing"], owner="trainer-b", step=1)

    await store.mark_consumed([s1], owner="trainer-c", step=3)
    assert (await store.get_session(s1)).train_state is TrainState.CONSUMED
    await store.release([s2, s1], owner="trainer-c")  # not c's / already consumed: no change
    assert (await store.get_session(s2)).train_state is TrainState.CLAIMED
    await store.release([s2], owner="trainer-b")
    assert (await store.get_session(s2)).train_state is TrainState.PENDING
    assert [t.session.id for t in await store.list_trainable(run.id)] == [s2]
    d_expires = time.monotonic() + LEASE
    (again,) = await store.claim(run.id, limit=10, owner="trainer-d", lease_seconds=LEASE)
    assert again.session.id == s2
    await store.mark_consumed([s2], owner="trainer-d", step=4)
    await sleep_until(d_expires)  # past the lease: consumed sessions never come back
    assert await store.list_trainable(run.id) == []
    assert await store.claim(run.id, limit=10, owner="trainer-e", lease_seconds=1) == []
    with pytest.raises(LeaseLostError):
        await store.mark_consumed([s2], owner="trainer-d", step=5)


async def test_concurrent_claims_get_disjoint_sets_that_cover_everything(store: Store) -> None:
    run = await store.create_run("race", {})
    ids = set()
    for i in range(20):
        sid = await one_turn_session(store, run.id, f"race-{i}")
        await store.add_reward(sid, float(i))
        await store.end_session(sid)
        ids.add(sid)
    first = await Store.connect(store.url, upgrade=False)
    second = await Store.connect(store.url, upgrade=False)
    try:
        a, b = await asyncio.gather(
            first.claim(run.id, limit=15, owner="a", lease_seconds=30),
            second.claim(run.id, limit=15, owner="b", lease_seconds=30),
        )
    finally:
        await first.close()
        await second.close()
    got_a, got_b = {t.session.id for t in a}, {t.session.id for t in b}
    assert not got_a & got_b
    assert got_a | got_b == ids
    assert sorted([len(got_a), len(got_b)]) == [5, 15]


async def test_run_counts_count_what_admission_bounds_in_every_state(store: Store) -> None:
    """Staleness admission's (running, accepted): running sessions are those not ended;
    accepted ones ended holding a reward the trainer reads and were not dropped by it, whether
    waiting, claimed or trained, and again once a crashed step's sessions are requeued."""
    run = await store.create_run("counts", {})
    sids = [await one_turn_session(store, run.id, f"n{i}") for i in range(9)]
    _active, active_rewarded, unrewarded, waiting, claimed, trained, dropped, failed, late = sids
    for sid in (active_rewarded, waiting, claimed, trained, dropped, late):
        await store.add_reward(sid, 1.0)
    for sid in (unrewarded, waiting, claimed, trained, dropped, late):
        await store.end_session(sid)
    await store.end_session(failed, failure="the agent fell over")
    assert await store.run_counts(run.id) == (2, 5)

    taken = await store.claim(run.id, limit=10, owner="t", lease_seconds=60)
    assert {t.session.id for t in taken} == {waiting, claimed, trained, dropped, late}
    await store.mark_consumed([trained, late], owner="t", step=1)  # late: trained, ...
    await store.add_reward(late, 2.0, late="record")  # ... then a late reward: still counted once
    await store.mark_consumed([dropped], owner="t", step=-1, outcome=Outcome.STALE)
    await store.release([waiting], owner="t")
    assert await store.run_counts(run.id) == (2, 4)  # waiting, claimed, trained, late

    assert await store.requeue_after(run.id, step=0) == 2  # the trainer's step 1 was lost
    assert await store.run_counts(run.id) == (2, 4)
