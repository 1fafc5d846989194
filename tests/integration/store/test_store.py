"""The trajectory store as the gateway and the trainer use it, on a real SQLite file and a real
PostgreSQL database (each test runs on both)."""

from __future__ import annotations

import asyncio
import hashlib
from datetime import UTC

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text

from store import (
    ConflictError,
    NotFoundError,
    SessionEndedError,
    Store,
    StoreError,
    migrate,
)
from store.db import Database
from store.tables import Base
from store.types import SessionStatus, TrainState, TurnStatus
from tests.support.store_records import count, new_session, one_turn_session, raw, rec
from tests.support.store_statements import statements_of


async def test_migrations_create_the_schema_from_empty_and_downgrade_then_upgrade(
    fresh_url: str,
) -> None:
    db = Database(fresh_url)
    try:
        assert await migrate.current_revision(db) is None
        with pytest.raises(StoreError, match="rlgateway db upgrade"):
            await Store.connect(fresh_url, upgrade=False)

        store = await Store.connect(fresh_url)
        await store.close()
        assert await migrate.current_revision(db) == migrate.head_revision()
        async with db.engine.connect() as conn:
            tables = set(await conn.run_sync(lambda c: inspect(c).get_table_names()))
            assert {"runs", "sessions", "segments", "completions", "rewards"} <= tables
            # The ORM models and the migrations describe the same schema.
            diff = await conn.run_sync(
                lambda c: compare_metadata(
                    MigrationContext.configure(c, opts={"compare_type": True}), Base.metadata
                )
            )
            assert diff == []

        await migrate.downgrade(db, "base")
        assert await migrate.current_revision(db) is None
        async with db.engine.connect() as conn:
            tables = set(await conn.run_sync(lambda c: inspect(c).get_table_names()))
            assert tables <= {"alembic_version"}

        await migrate.upgrade(db)
        if db.dialect == "sqlite":
            async with raw(fresh_url) as conn:
                mode = (await conn.exec_driver_sql("PRAGMA journal_mode")).scalar_one()
            assert mode == "wal"
        store = await Store.connect(fresh_url, upgrade=False)
        run = await store.create_run("after round trip", {"lr": 1e-6})
        assert (await store.get_run(run.id)).config == {"lr": 1e-6}
        await store.close()
    finally:
        await db.dispose()


# runs and sessions


async def test_runs_sessions_and_bearer_keys(store: Store, store_url: str) -> None:
    run = await store.create_run("math", {"algorithm": "grpo", "eta": 2})
    assert run.id.startswith("run_")
    assert len(run.id) == 4 + 24
    assert run.status == "active"
    assert run.created_at.tzinfo is UTC
    assert await store.get_run(run.id) == run
    with pytest.raises(NotFoundError):
        await store.get_run("run_missing")

    created = await store.create_sessions(run.id, 3, group_id="prompt-7", metadata={"task": 7})
    assert len({n.info.id for n in created}) == 3
    for new in created:
        assert new.info.id.startswith("sess_")
        assert len(new.info.id) == 5 + 24
        assert new.api_key.startswith("rlg-")
        assert len(new.api_key) > 40
        assert new.info.group_id == "prompt-7"
        assert new.info.metadata == {"task": 7}
        assert new.info.status is SessionStatus.ACTIVE
        assert new.info.train_state is TrainState.PENDING
        assert await store.session_for_key(new.api_key) == new.info
        assert await store.get_session(new.info.id) == new.info
    assert await store.session_for_key("rlg-not-a-key") is None

    # The key is stored only as its sha256.
    first = created[0]
    async with raw(store_url) as conn:
        row = (
            await conn.execute(text("SELECT * FROM sessions WHERE id = :id"), {"id": first.info.id})
        ).one()
    assert row.key_hash == hashlib.sha256(first.api_key.encode()).hexdigest()
    assert all(first.api_key not in str(value) for value in row)

    with pytest.raises(ValueError, match="between 1 and 1024"):
        await store.create_sessions(run.id, 0)
    with pytest.raises(ValueError, match="between 1 and 1024"):
        await store.create_sessions(run.id, 1025)
    with pytest.raises(NotFoundError, match="run_missing"):
        await store.create_sessions("run_missing", 1)
    with pytest.raises(NotFoundError, match="run_missing"):  # admitted under the run's lock
        await store.create_sessions("run_missing", 1, admit=lambda running, accepted: None)
    with pytest.raises(NotFoundError):
        await store.get_session("sess_missing")
    with pytest.raises(NotFoundError):
        await store.end_session("sess_missing")

    ended = await store.end_session(first.info.id)
    assert ended.status is SessionStatus.ENDED
    assert ended.ended_at is not None
    assert ended.ended_at.tzinfo is UTC
    again = await store.end_session(first.info.id)
    assert again.ended_at == ended.ended_at


# turns and segments


async def test_record_completions_builds_segments_token_for_token(
    store: Store, store_url: str
) -> None:
    sid = await new_session(store)
    # Segment 0: three turns, each prompt extending the segment's exact tokens.
    await store.record_completions(
        [rec("t0", sid, 0, prompt=[1, 2, 3], prefix_len=0, output=[10, 11],
             logprobs=[-0.5, -0.25], versions=[0, 0], opens=True)]
    )  # fmt: skip
    await store.record_completions(
        [rec("t1", sid, 0, prompt=[1, 2, 3, 10, 11, 4, 5], prefix_len=5, output=[12],
             logprobs=[-1.0], versions=[1])]
    )  # fmt: skip
    await store.record_completions(
        [rec("t2", sid, 0, prompt=[1, 2, 3, 10, 11, 4, 5, 12, 6], prefix_len=8,
             output=[13, 14, 15], logprobs=[-0.125, -2.0, -4.0], versions=[1, 1, 2],
             status=TurnStatus.ABORTED, finish_reason="abort")]
    )  # fmt: skip
    # Segment 1: a prefix break (edited history).
    await store.record_completions(
        [rec("t3", sid, 1, prompt=[1, 2, 7], prefix_len=0, output=[20], logprobs=[-3.0],
             versions=[2], opens=True, prefix_break=True)]
    )  # fmt: skip
    # n = 2: both choices arrive together, each opening its own segment.
    await store.record_completions(
        [
            rec("t4-0", sid, 2, prompt=[1, 9], prefix_len=0, output=[30, 31],
                logprobs=[-0.75, -1.5], versions=[3, 3], opens=True, prefix_break=True),
            rec("t4-1", sid, 3, prompt=[1, 9], prefix_len=0, output=[40], logprobs=[-6.0],
                versions=[3], opens=True, finish_reason="length"),
        ]
    )  # fmt: skip

    states = await store.load_segments(sid)
    assert [s.index for s in states] == [0, 1, 2, 3]
    assert [s.tokens for s in states] == [
        [1, 2, 3, 10, 11, 4, 5, 12, 6, 13, 14, 15],
        [1, 2, 7, 20],
        [1, 9, 30, 31],
        [1, 9, 40],
    ]
    assert states[0].transcript == {"messages": [{"role": "user", "content": "t2"}]}
    assert (await store.get_session(sid)).prefix_breaks == 2

    detail = await store.session_detail(sid)
    seg0, seg1, seg2, seg3 = detail.segments
    assert seg0.tokens == states[0].tokens
    assert seg0.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1, 0, 1, 1, 1]
    assert seg0.logprobs == [0.0, 0.0, 0.0, -0.5, -0.25, 0.0, 0.0, -1.0, 0.0, -0.125, -2.0, -4.0]
    assert seg0.versions == [-1, -1, -1, 0, 0, -1, -1, 1, -1, 1, 1, 2]
    assert seg0.completion_ids == ["t0", "t1", "t2"]
    assert seg0.turn_spans == [(3, 5), (7, 8), (9, 12)]
    assert (seg1.loss_mask, seg1.versions, seg1.turn_spans) == (
        [0, 0, 0, 1],
        [-1, -1, -1, 2],
        [(3, 4)],
    )
    assert (seg2.completion_ids, seg3.completion_ids) == (["t4-0"], ["t4-1"])
    assert seg3.logprobs == [0.0, 0.0, -6.0]
    for seg in detail.segments:
        assert len(seg.tokens) == len(seg.loss_mask) == len(seg.logprobs) == len(seg.versions)
    assert list(detail.finish_reasons) == ["t0", "t1", "t2", "t3", "t4-0", "t4-1"]
    assert detail.finish_reasons["t2"] == "abort"
    assert detail.finish_reasons["t4-1"] == "length"

    # Arrays are stored as binary, 4 bytes a value; the prompt as its delta only.
    async with raw(store_url) as conn:
        row = (
            await conn.execute(
                text("SELECT prompt_delta, output_ids, logprobs, versions FROM completions "
                     "WHERE id = 't2'")
            )
        ).one()  # fmt: skip
        columns = await conn.run_sync(lambda c: inspect(c).get_columns("completions"))
    assert all(isinstance(v, bytes) for v in row)
    assert [len(v) for v in row] == [4 * 1, 4 * 3, 4 * 3, 4 * 3]
    kinds = {c["name"]: type(c["type"]).__name__.upper() for c in columns}
    for name in ("prompt_delta", "output_ids", "logprobs", "versions"):
        assert kinds[name] in {"BLOB", "BYTEA", "LARGEBINARY"}, kinds[name]


async def test_refused_turns_write_nothing(store: Store, store_url: str) -> None:
    sid = await new_session(store)
    await store.record_completions(
        [rec("a0", sid, 0, prompt=[1, 2], prefix_len=0, output=[3, 4], opens=True)]
    )
    before = {t: await count(store_url, t, sid) for t in ("segments", "completions")}
    assert before == {"segments": 1, "completions": 1}

    # A batch whose second record starts from a stale prefix: the first must not land either.
    with pytest.raises(ConflictError, match=r"prefix_len is 3 .* holds 4 tokens"):
        await store.record_completions(
            [
                rec("a1", sid, 1, prompt=[5], prefix_len=0, output=[6], opens=True,
                    prefix_break=True),
                rec("a2", sid, 0, prompt=[1, 2, 3, 9], prefix_len=3, output=[7]),
            ]
        )  # fmt: skip
    with pytest.raises(NotFoundError, match="no segment"):
        await store.record_completions([rec("a3", sid, 5, prompt=[1], prefix_len=0, output=[1])])
    with pytest.raises(ConflictError, match="already recorded"):
        await store.record_completions(
            [rec("a0", sid, 1, prompt=[1], prefix_len=0, output=[1], opens=True)]
        )
    with pytest.raises(ConflictError, match="already has segment"):
        await store.record_completions(
            [rec("a4", sid, 0, prompt=[1], prefix_len=0, output=[1], opens=True)]
        )
    with pytest.raises(ValueError, match="share one length"):
        await store.record_completions(
            [rec("a5", sid, 0, prompt=[1, 2, 3, 4], prefix_len=4, output=[1], logprobs=[])]
        )
    with pytest.raises(NotFoundError):
        await store.record_completions(
            [rec("a6", "sess_missing", 0, prompt=[1], prefix_len=0, output=[1], opens=True)]
        )
    with pytest.raises(NotFoundError):
        await store.load_segments("sess_missing")
    with pytest.raises(NotFoundError):
        await store.session_detail("sess_missing")
    assert {t: await count(store_url, t, sid) for t in ("segments", "completions")} == before
    info = await store.get_session(sid)
    assert info.prefix_breaks == 0
    assert [s.tokens for s in await store.load_segments(sid)] == [[1, 2, 3, 4]]

    # The segment is intact: the right prefix still extends it, as turn 1.
    await store.record_completions(
        [rec("a7", sid, 0, prompt=[1, 2, 3, 4, 8], prefix_len=4, output=[9])]
    )
    await store.end_session(sid)
    with pytest.raises(SessionEndedError, match="has ended"):
        await store.record_completions(
            [rec("a8", sid, 0, prompt=[1, 2, 3, 4, 8, 9], prefix_len=6, output=[1])]
        )
    assert await count(store_url, "completions", sid) == 2
    detail = await store.session_detail(sid)
    assert list(detail.finish_reasons) == ["a0", "a7"]


async def test_concurrent_writers_never_hit_a_locked_database(store: Store) -> None:
    """Many sessions writing at once, from one Store and from a second one on the same
    database (the trainer beside the gateway), all commit."""
    run = await store.create_run("load", {})
    other = await Store.connect(store.url, upgrade=False)
    try:
        sessions = [n.info.id for n in await store.create_sessions(run.id, 24)]

        async def agent(s: Store, sid: str) -> None:
            tokens: list[int] = []
            for turn in range(4):
                prompt = [*tokens, 100 + turn]
                await s.record_completions(
                    [rec(f"{sid}-{turn}", sid, 0, prompt=prompt, prefix_len=len(tokens),
                         output=[7] * 32, opens=turn == 0)]
                )  # fmt: skip
                tokens = [*prompt, *[7] * 32]
                await s.add_reward(sid, 0.5, completion_id=f"{sid}-{turn}")
            await s.end_session(sid)

        await asyncio.gather(
            *(agent(store if i % 2 else other, sid) for i, sid in enumerate(sessions))
        )
    finally:
        await other.close()
    trajectories = await store.list_trainable(run.id, limit=100)
    assert len(trajectories) == 24
    assert all(len(t.segments[0].tokens) == 4 * 33 for t in trajectories)
    assert all(t.reward == pytest.approx(2.0) for t in trajectories)


async def test_concurrent_turns_commit_together_and_fail_alone(
    store: Store, store_url: str
) -> None:
    """A burst of turns (the gateway's decode step finishing many at once) commits as one group,
    on both backends; a turn that must fail (its session ended) fails alone and writes nothing."""
    run = await store.create_run("burst", {})
    sids = [n.info.id for n in await store.create_sessions(run.id, 12)]
    await store.end_session(sids[5])
    results = await asyncio.gather(
        *(
            store.record_completions(
                [rec(f"{sid}-0", sid, 0, prompt=[1, 2], prefix_len=0, output=[3] * 8, opens=True)]
            )
            for sid in sids
        ),
        return_exceptions=True,
    )
    assert isinstance(results[5], SessionEndedError)
    assert all(r is None for i, r in enumerate(results) if i != 5)
    assert await count(store_url, "completions", sids[5]) == 0
    assert await count(store_url, "segments", sids[5]) == 0
    for i, sid in enumerate(sids):
        if i != 5:
            assert await count(store_url, "completions", sid) == 1


async def test_a_turn_costs_a_few_statements_and_a_burst_no_more(store: Store) -> None:
    """The commit path is set-based: one turn is a handful of SQL statements, and a burst of 32
    turns (one group commit) costs no more than two or three turns would, on both backends;
    without group commit (`Store.connect(group_commit=False)`) each turn pays its own."""
    run = await store.create_run("statements", {})
    sids = [n.info.id for n in await store.create_sessions(run.id, 65)]

    async def burst(s: Store, group: list[str]) -> int:
        statements.clear()
        await asyncio.gather(
            *(
                s.record_completions(
                    [rec(f"{sid}-0", sid, 0, prompt=[1], prefix_len=0, output=[2], opens=True)]
                )
                for sid in group
            )
        )
        return len(statements)

    alone = await Store.connect(store.url, upgrade=False, group_commit=False)
    try:
        with statements_of(store, alone) as statements:
            first = [rec(f"{sids[0]}-0", sids[0], 0, prompt=[1, 2], prefix_len=0, output=[3],
                         opens=True)]  # fmt: skip
            await store.record_completions(first)
            opening = len(statements)
            statements.clear()
            await store.record_completions(
                [rec(f"{sids[0]}-1", sids[0], 0, prompt=[1, 2, 3, 4], prefix_len=3, output=[5])]
            )
            extending = len(statements)
            grouped = await burst(store, sids[1:33])
            ungrouped = await burst(alone, sids[33:])
    finally:
        await alone.close()
    assert opening <= 6, statements
    assert extending <= 7, statements
    assert grouped <= 3 * 6, f"{grouped} statements for 32 turns"
    assert ungrouped >= 32 * 2, f"{ungrouped} statements for 32 turns, each its own"
    for sid in sids[1:]:
        assert (await store.session_detail(sid)).segments[0].tokens == [1, 2]


# rewards and returns


async def test_rewards_are_idempotent_by_key(store: Store, store_url: str) -> None:
    run = await store.create_run("rewards", {})
    sid = await one_turn_session(store, run.id, "r-turn")
    other = await one_turn_session(store, run.id, "r-other")

    assert await store.add_reward(sid, 1.0, key="grader") is True
    assert await store.add_reward(sid, 1.0, key="grader") is False
    assert await count(store_url, "rewards", sid) == 1
    with pytest.raises(ConflictError, match=r"already holds 1\.0"):
        await store.add_reward(sid, 0.0, key="grader")
    with pytest.raises(ConflictError):
        await store.add_reward(sid, 1.0, key="grader", completion_id="r-turn")
    assert await store.add_reward(sid, 0.5, completion_id="r-turn") is True
    assert await store.add_reward(sid, 0.5, completion_id="r-turn") is True  # keyless: new row
    assert await count(store_url, "rewards", sid) == 3

    with pytest.raises(NotFoundError, match="no completion"):
        await store.add_reward(sid, 1.0, completion_id="missing")
    with pytest.raises(NotFoundError, match="no completion"):
        await store.add_reward(sid, 1.0, completion_id="r-other")  # another session's turn
    with pytest.raises(NotFoundError):
        await store.add_reward("sess_missing", 1.0)
    for bad in (float("nan"), float("inf"), float("-inf")):
        with pytest.raises(ValueError, match="finite"):
            await store.add_reward(sid, bad)

    await store.end_session(sid)
    assert await store.add_reward(sid, 2.0, key="late-human-label") is True
    detail = await store.session_detail(sid)
    assert [(r.value, r.completion_id, r.key) for r in detail.rewards] == [
        (1.0, None, "grader"),
        (0.5, "r-turn", None),
        (0.5, "r-turn", None),
        (2.0, None, "late-human-label"),
    ]
    assert all(r.created_at.tzinfo is UTC for r in detail.rewards)
    assert await count(store_url, "rewards", other) == 0
