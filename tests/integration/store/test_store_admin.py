"""The store's run-management side on SQLite and PostgreSQL: run keys and status, deletion with
every row of the run, training steps, session filters and pages, the export iterator, rewards set
by hand, and migration 0002's backfill of version ranges."""

from __future__ import annotations

import struct
from typing import Any

import pytest
from sqlalchemy import text

from store import NotFoundError, Store, migrate
from store.db import Database, utcnow
from store.types import RunStatus, SessionFilter, SessionStatus, TrainState
from tests.support.store_records import raw, rec


async def session_with_turns(
    store: Store,
    run_id: str,
    cid: str,
    *,
    versions: list[list[int]],
    prefix_break: bool = False,
    reward: float | None = None,
    end: bool = True,
    group_id: str | None = None,
) -> str:
    """A session whose turns sample with the given policy versions (one list per turn)."""
    (new,) = await store.create_sessions(run_id, 1, group_id=group_id)
    sid = new.info.id
    length = 0
    for t, vs in enumerate(versions):
        prompt = [*list(range(length)), 7, 8]
        await store.record_completions(
            [
                rec(
                    f"{cid}-{t}",
                    sid,
                    0,
                    prompt=prompt,
                    prefix_len=length,
                    output=[3] * len(vs),
                    versions=vs,
                    opens=t == 0,
                )
            ]
        )
        length = len(prompt) + len(vs)
    if prefix_break:
        await store.record_completions(
            [
                rec(
                    f"{cid}-b",
                    sid,
                    1,
                    prompt=[9],
                    prefix_len=0,
                    output=[4],
                    versions=[versions[-1][-1]],
                    opens=True,
                    prefix_break=True,
                )
            ]
        )
    if reward is not None:
        await store.add_reward(sid, reward)
    if end:
        await store.end_session(sid)
    return sid


async def table_counts(url: str, run_id: str) -> dict[str, int]:
    async with raw(url) as conn:
        sql = {
            "runs": "SELECT COUNT(*) FROM runs WHERE id = :r",
            "sessions": "SELECT COUNT(*) FROM sessions WHERE run_id = :r",
            "segments": "SELECT COUNT(*) FROM segments s JOIN sessions x ON s.session_id = x.id "
            "WHERE x.run_id = :r",
            "completions": "SELECT COUNT(*) FROM completions c JOIN sessions x ON "
            "c.session_id = x.id WHERE x.run_id = :r",
            "rewards": "SELECT COUNT(*) FROM rewards w JOIN sessions x ON w.session_id = x.id "
            "WHERE x.run_id = :r",
            "train_steps": "SELECT COUNT(*) FROM train_steps WHERE run_id = :r",
            "all_segments": "SELECT COUNT(*) FROM segments",
            "all_completions": "SELECT COUNT(*) FROM completions",
            "all_rewards": "SELECT COUNT(*) FROM rewards",
        }
        return {
            k: int((await conn.execute(text(q), {"r": run_id})).scalar_one())
            for k, q in sql.items()
        }


async def test_run_keys_are_hashed_replaceable_and_scoped(store: Store, store_url: str) -> None:
    run = await store.create_run("keys", {})
    key = await store.new_run_key(run.id)
    assert key.startswith("rlr-")
    assert (await store.run_for_key(key)) == run
    assert await store.run_for_key(key + "x") is None
    async with raw(store_url) as conn:
        stored = (
            await conn.execute(text("SELECT key_hash FROM runs WHERE id = :r"), {"r": run.id})
        ).scalar_one()
    assert key not in stored
    assert len(stored) == 64
    newer = await store.new_run_key(run.id)
    assert await store.run_for_key(key) is None
    assert (await store.run_for_key(newer)).id == run.id  # type: ignore[union-attr]
    with pytest.raises(NotFoundError):
        await store.new_run_key("run_nope")


async def test_status_and_list_counts(store: Store) -> None:
    run = await store.create_run("counted", {"batch_size": 2})
    await session_with_turns(store, run.id, "c1", versions=[[0]], reward=1.0)
    await session_with_turns(store, run.id, "c2", versions=[[0]], end=False)
    await store.record_step(run.id, 1, version=1, metrics={"loss": 0.5})
    assert (await store.set_run_status(run.id, RunStatus.PAUSED)).status == "paused"
    summary = next(r for r in await store.list_runs() if r.run.id == run.id)
    assert summary.run.status == "paused"
    assert (summary.sessions, summary.active, summary.rewarded, summary.consumed) == (2, 1, 1, 0)
    assert summary.last_step == 1
    with pytest.raises(NotFoundError):
        await store.set_run_status("run_nope", RunStatus.STOPPED)


async def test_delete_run_removes_every_row_of_it_and_nothing_else(
    store: Store, store_url: str
) -> None:
    keep = await store.create_run("keep", {})
    kept = await session_with_turns(store, keep.id, "keep", versions=[[0]], reward=1.0)
    before_other = await table_counts(store_url, keep.id)
    run = await store.create_run("doomed", {})
    ids = [
        await session_with_turns(store, run.id, f"d{i}", versions=[[0], [1]], reward=0.5)
        for i in range(3)
    ]
    await store.record_step(run.id, 1, version=1, metrics={"loss": 1.0})
    counts = await table_counts(store_url, run.id)
    assert counts["sessions"] == 3
    assert counts["completions"] == 6
    assert counts["rewards"] == 3
    assert sorted(await store.delete_run(run.id)) == sorted(ids)
    after = await table_counts(store_url, run.id)
    for table in ("runs", "sessions", "segments", "completions", "rewards", "train_steps"):
        assert after[table] == 0, table
    assert after["all_completions"] == before_other["all_completions"]
    assert after["all_rewards"] == before_other["all_rewards"]
    assert (await store.session_detail(kept)).rewards[0].value == 1.0
    with pytest.raises(NotFoundError):
        await store.delete_run(run.id)
    with pytest.raises(NotFoundError):
        await store.get_session(ids[0])


async def test_training_steps_time_series(store: Store) -> None:
    run = await store.create_run("steps", {})
    for step in (1, 2, 3):
        await store.record_step(
            run.id,
            step,
            version=step,
            metrics={"loss": 1.0 / step, "reward_mean": step * 0.1, "bad": float("nan")},
            checkpoint=f"/ckpt/step-{step:06d}",
        )
    await store.record_step(run.id, 3, version=3, metrics={"loss": 0.25})  # retrained after a crash
    rows = await store.list_steps(run.id)
    assert [r.step for r in rows] == [1, 2, 3]
    assert rows[0].metrics == {"loss": 1.0, "reward_mean": 0.1, "bad": None}
    assert rows[2].metrics == {"loss": 0.25}
    assert rows[2].checkpoint is None
    assert [r.step for r in await store.list_steps(run.id, after=1)] == [2, 3]
    other = await store.create_run("no steps", {})
    latest = await store.latest_steps([run.id, other.id])
    assert set(latest) == {run.id}
    assert latest[run.id].step == 3
    with pytest.raises(NotFoundError):
        await store.record_step("run_nope", 1, version=1, metrics={})


async def test_session_filters_and_pages(store: Store) -> None:
    run = await store.create_run("browse", {})
    low = await session_with_turns(store, run.id, "low", versions=[[0, 0]], reward=-1.0)
    mid = await session_with_turns(store, run.id, "mid", versions=[[1], [2, 2]], reward=0.5)
    high = await session_with_turns(
        store, run.id, "high", versions=[[3]], reward=2.0, prefix_break=True, group_id="g"
    )
    await store.add_reward(high, 1.0)  # total 3.0
    live = await session_with_turns(store, run.id, "live", versions=[[5]], end=False)
    other = await store.create_run("other", {})
    await session_with_turns(store, other.id, "other", versions=[[1]], reward=0.5)

    async def ids(**kw: Any) -> set[str]:
        page, total = await store.list_sessions(run.id, SessionFilter(**kw), limit=500)
        assert total == len(page)
        return {s.info.id for s in page}

    assert await ids() == {low, mid, high, live}
    assert await ids(status=SessionStatus.ACTIVE) == {live}
    assert await ids(status=SessionStatus.ENDED) == {low, mid, high}
    assert await ids(min_reward=0.0) == {mid, high}
    assert await ids(min_reward=0.5, max_reward=0.5) == {mid}
    assert await ids(max_reward=2.9) == {low, mid}
    assert await ids(rewarded=False) == {live}
    assert await ids(min_version=2, max_version=2) == {mid}
    assert await ids(min_version=3) == {high, live}
    assert await ids(max_version=0) == {low}
    assert await ids(min_prefix_breaks=1) == {high}
    assert await ids(max_prefix_breaks=0) == {low, mid, live}
    assert await ids(group_id="g") == {high}
    assert await ids(train_state=TrainState.PENDING) == {low, mid, high, live}
    page, total = await store.list_sessions(run.id, SessionFilter(), limit=3)
    assert total == 4
    assert [s.info.id for s in page] == [live, high, mid]
    assert page[1].reward == 3.0
    assert page[1].turns == 2
    assert page[0].reward is None
    rest, _ = await store.list_sessions(run.id, SessionFilter(), limit=3, offset=3)
    assert [s.info.id for s in rest] == [low]
    with pytest.raises(ValueError, match="limit"):
        await store.list_sessions(run.id, SessionFilter(), limit=0)


async def test_export_iterates_every_matching_session_in_batches(store: Store) -> None:
    run = await store.create_run("export", {})
    made = [
        await session_with_turns(store, run.id, f"e{i}", versions=[[i]], reward=float(i))
        for i in range(5)
    ]
    got = []
    async for detail, transcripts in store.export_sessions(
        run.id, SessionFilter(min_reward=1.0), gamma=1.0
    ):
        got.append(detail.info.id)
        assert transcripts[detail.segments[0].id]["messages"][0]["content"].endswith("-0")
    assert got == made[1:]  # oldest first, filtered
    from store import browse

    small = [
        loaded.info.id
        async for loaded, _ in browse.iter_sessions(store._db, run.id, SessionFilter(), batch=2)
    ]
    assert small == made


async def test_set_reward_replaces_the_targets_rewards_only(store: Store) -> None:
    run = await store.create_run("manual", {})
    sid = await session_with_turns(store, run.id, "m", versions=[[0], [0]], reward=1.0)
    await store.add_reward(sid, 5.0, completion_id="m-0", key="grader")
    await store.add_reward(sid, 2.0)  # a second final reward: total final 3.0
    await store.set_reward(sid, -1.0)
    d = await store.session_detail(sid)
    finals = [r for r in d.rewards if r.completion_id is None]
    assert [(r.value, r.key) for r in finals] == [(-1.0, "manual:final")]
    assert [(r.value, r.key) for r in d.rewards if r.completion_id == "m-0"] == [(5.0, "grader")]
    await store.set_reward(sid, 0.25, completion_id="m-0")
    await store.set_reward(sid, 0.5, completion_id="m-0")  # overriding again replaces it
    d = await store.session_detail(sid)
    assert sorted((r.completion_id, r.value) for r in d.rewards if r.completion_id) == [
        ("m-0", 0.5)
    ]
    assert d.returns == {"m-0": 0.5 + -1.0, "m-1": -1.0}
    with pytest.raises(NotFoundError):
        await store.set_reward(sid, 1.0, completion_id="nope")
    with pytest.raises(NotFoundError):
        await store.set_reward("sess_nope", 1.0)
    with pytest.raises(ValueError, match="finite"):
        await store.set_reward(sid, float("inf"))


async def test_migration_0002_backfills_version_ranges(fresh_url: str) -> None:
    db = Database(fresh_url)
    try:
        await migrate.upgrade(db, "0001")
        now = utcnow()
        async with db.write_engine.begin() as conn:
            await conn.execute(
                text(
                    "INSERT INTO runs (id, name, config, status, created_at) "
                    "VALUES ('run_a', 'a', '{}', 'active', :now)"
                ),
                {"now": now},
            )
            await conn.execute(
                text(
                    "INSERT INTO sessions (id, run_id, metadata, key_hash, created_at, "
                    "prefix_breaks, turn_count, train_state) VALUES ('sess_a', 'run_a', '{}', "
                    "'h', :now, 0, 2, 'pending')"
                ),
                {"now": now},
            )
            await conn.execute(
                text(
                    "INSERT INTO segments (id, session_id, position, transcript, length, "
                    "created_at) VALUES ('seg', 'sess_a', 0, '{}', 4, :now)"
                ),
                {"now": now},
            )
            for cid, turn, versions in (("c0", 0, [2, 3, 3]), ("c1", 1, [])):
                blob = struct.pack(f"<{len(versions)}i", *versions)
                await conn.execute(
                    text(
                        "INSERT INTO completions (id, session_id, segment_id, turn, prefix_len, "
                        "prompt_delta, output_ids, logprobs, versions, finish_reason, status, "
                        "sampling, request, response, latency_ms, created_at) VALUES (:id, "
                        "'sess_a', 'seg', :turn, 0, :b, :b, :b, :v, 'stop', 'ok', '{}', '{}', "
                        "'{}', 1.0, :now)"
                    ),
                    {"id": cid, "turn": turn, "b": b"", "v": blob, "now": now},
                )
        await migrate.upgrade(db)
        async with db.engine.connect() as conn:
            found = await conn.execute(text("SELECT id, min_version, max_version FROM completions"))
            rows = {cid: (lo, hi) for cid, lo, hi in found}
        assert rows == {"c0": (2, 3), "c1": (None, None)}
        await migrate.downgrade(db, "0001")  # and back: the 0001 rows survive
        async with db.engine.connect() as conn:
            n = (await conn.execute(text("SELECT COUNT(*) FROM completions"))).scalar_one()
        assert n == 2
    finally:
        await db.dispose()
