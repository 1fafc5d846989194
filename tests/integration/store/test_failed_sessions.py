"""An agent (or the experiment runner) that knows its episode failed ends its session as failed:
the session is settled `failed` at once with its reason, never trained, counted, and its group
trains without it at once instead of waiting for its deadline. The store on a real SQLite file
and a real PostgreSQL database; the HTTP route in process on the tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.local import LocalEngine
from store import ConflictError, Store
from store.sessions import MAX_FAILURE_CHARS
from store.types import Outcome, SessionStatus, TrainState
from tests.support.admin_client import ADMIN, app_client, bearer, parse_prometheus
from tests.support.store_records import OWNER, claim, group, ids, outcomes

DEADLINE = 900.0
"""The default `group_deadline_seconds`: no test here waits for it."""


@pytest.mark.parametrize("partial", ["wait", "drop"])
async def test_a_group_with_a_failed_member_trains_without_it_at_once(
    store: Store, partial: str
) -> None:
    run = await store.create_run("t", {})
    done = await group(store, run.id, "g", 3)
    # the fourth agent's reward function raised after it had posted a partial reward
    (broken,) = await group(store, run.id, "g", 1, end=False, reward=0.5)
    before = await claim(
        store, run.id, batch_size=3, group_size=4, partial_groups=partial, deadline_seconds=DEADLINE
    )
    assert (before.trajectories, before.incomplete, before.waiting_groups) == ([], [], 1)

    info = await store.end_session(broken, failure="reward function raised: KeyError('answer')")
    assert info.status == SessionStatus.ENDED
    assert (info.outcome, info.failure) == (
        Outcome.FAILED,
        "reward function raised: KeyError('answer')",
    )
    assert (info.train_state, info.consumed_step) == (TrainState.CONSUMED, -1)

    got = await claim(
        store, run.id, batch_size=3, group_size=4, partial_groups=partial, deadline_seconds=DEADLINE
    )
    assert ids(got.trajectories) == set(done)
    assert (got.incomplete, got.waiting_groups) == ([], 0)
    await store.mark_consumed(done, owner=OWNER, step=1)
    assert await outcomes(store, [*done, broken]) == {
        **dict.fromkeys(done, "trained"),
        broken: "failed",
    }
    assert await store.outcome_counts(run.id) == {o.value: 0 for o in Outcome} | {
        "trained": 3,
        "failed": 1,
        "pending": 0,
    }
    # it holds a reward, and is still never claimed
    again = await claim(store, run.id, batch_size=1, group_size=1, partial_groups="use")
    assert again.trajectories == []
    assert (await store.get_session(broken)).failure == "reward function raised: KeyError('answer')"


async def test_a_group_whose_members_all_failed_has_nothing_to_claim_and_nothing_waits(
    store: Store,
) -> None:
    run = await store.create_run("t", {})
    sids = await group(store, run.id, "g", 2, end=False)
    for sid in sids:
        await store.end_session(sid, failure="agent subprocess exited with code 137")
    got = await claim(store, run.id, batch_size=1, group_size=2, deadline_seconds=DEADLINE)
    assert (got.trajectories, got.incomplete, got.waiting_groups) == ([], [], 0)
    assert await outcomes(store, sids) == dict.fromkeys(sids, "failed")


async def test_an_ended_session_fails_until_the_trainer_takes_it_then_409(store: Store) -> None:
    run = await store.create_run("t", {})
    (late,) = await group(store, run.id, None, 1)  # ended and rewarded, not claimed yet
    info = await store.end_session(late, failure="grader timed out")
    assert (info.outcome, info.failure) == (Outcome.FAILED, "grader timed out")

    (taken,) = await group(store, run.id, None, 1)
    got = await claim(store, run.id, batch_size=1, group_size=1)
    assert ids(got.trajectories) == {taken}
    with pytest.raises(ConflictError, match="is claimed by the trainer"):
        await store.end_session(taken, failure="too late")
    await store.mark_consumed([taken], owner=OWNER, step=1)
    with pytest.raises(ConflictError, match="was trained at step 1"):
        await store.end_session(taken, failure="too late")
    info = await store.get_session(taken)
    assert (info.outcome, info.failure, info.consumed_step) == (Outcome.TRAINED, None, 1)


async def test_failing_again_with_the_same_reason_changes_nothing(store: Store) -> None:
    run = await store.create_run("t", {})
    (sid,) = await group(store, run.id, "g", 1, end=False, reward=None)
    long = "Traceback (most recent call last):\n" + "x" * 600
    first = await store.end_session(sid, failure=long)
    assert first.failure == long[:MAX_FAILURE_CHARS]
    assert await store.end_session(sid, failure=long) == first
    assert await store.end_session(sid) == first  # a plain end after it: still failed
    with pytest.raises(ConflictError, match="already failed"):
        await store.end_session(sid, failure="another reason")
    with pytest.raises(ConflictError, match="was settled as failed"):
        await store.add_reward(sid, 1.0)
    with pytest.raises(ValueError, match="must not be empty"):
        await store.end_session(sid, failure="")
    assert await store.get_session(sid) == first
    # PostgreSQL text holds no NUL: it is kept as U+FFFD on both backends
    (other,) = await group(store, run.id, "g", 1, end=False, reward=None)
    assert (await store.end_session(other, failure="bad\x00byte")).failure == "bad\ufffdbyte"


async def test_ending_a_session_as_failed_over_http(
    engine: LocalEngine,
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    async with app_client(engine, tiny_model, f"sqlite:///{tmp_path / 'h.db'}") as c:
        run = await c.run({"batch_size": 2, "group_size": 2})
        plain, empty, failed, taken = await c.sessions(run["id"], 4)
        for s in (plain, empty, failed, taken):
            await c.chat(s)

        # no body, and an empty one: ended as before, nothing settled
        r = await c.http.post(f"/sessions/{plain['id']}/end", headers=bearer(plain["api_key"]))
        assert r.status_code == 200, r.text
        assert (r.json()["status"], r.json()["outcome"], r.json()["failure"]) == (
            "ended",
            None,
            None,
        )
        r = await c.http.post(
            f"/sessions/{empty['id']}/end",
            content=b"",
            headers=bearer(empty["api_key"]) | {"Content-Type": "application/json"},
        )
        assert r.status_code == 200, r.text
        assert (r.json()["status"], r.json()["outcome"]) == ("ended", None)

        # a reason: out of range is refused, a good one settles it at once
        key = bearer(failed["api_key"])
        for bad in ("", "x" * (MAX_FAILURE_CHARS + 1)):
            r = await c.http.post(
                f"/sessions/{failed['id']}/end", json={"failure": bad}, headers=key
            )
            assert r.status_code == 422, r.text
        assert (await c.store.get_session(failed["id"])).status == SessionStatus.ACTIVE
        body = {"failure": "agent crashed: exit code 1"}
        r = await c.http.post(f"/sessions/{failed['id']}/end", json=body, headers=key)
        assert r.status_code == 200, r.text
        out = r.json()
        assert (out["status"], out["outcome"], out["failure"], out["consumed_step"]) == (
            "ended",
            "failed",
            "agent crashed: exit code 1",
            -1,
        )
        again = await c.http.post(f"/sessions/{failed['id']}/end", json=body, headers=key)
        assert (again.status_code, again.json()) == (200, out)
        other = await c.http.post(
            f"/sessions/{failed['id']}/end", json={"failure": "something else"}, headers=key
        )
        assert other.status_code == 409, other.text
        detail = (await c.http.get(f"/sessions/{failed['id']}", headers=ADMIN)).json()
        assert (detail["outcome"], detail["failure"]) == ("failed", "agent crashed: exit code 1")

        # one the trainer took cannot fail
        await c.http.post(f"/sessions/{taken['id']}/reward", json={"reward": 1}, headers=ADMIN)
        await c.http.post(f"/sessions/{taken['id']}/end", headers=ADMIN)
        got = await claim(c.store, run["id"], batch_size=1, group_size=1)
        assert taken["id"] in ids(got.trajectories)
        r = await c.http.post(
            f"/sessions/{taken['id']}/end", json={"failure": "too late"}, headers=ADMIN
        )
        assert r.status_code == 409, r.text
        assert "is claimed by the trainer" in r.json()["error"]["message"]

        counts = (await c.http.get(f"/runs/{run['id']}", headers=ADMIN)).json()["outcomes"]
        assert (counts["failed"], counts["pending"]) == (1, 3)
        samples = parse_prometheus((await c.http.get("/metrics", headers=ADMIN)).text)
        rid = run["id"]
        assert samples[f'rlgateway_run_sessions{{outcome="failed",run="{rid}"}}'] == 1
