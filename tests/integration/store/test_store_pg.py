"""The PostgreSQL hot path written against asyncpg itself (`store.turns_pg`,
`store.sessions_pg`): its statement count, what it writes as SQLAlchemy reads it back, and a race
only PostgreSQL's concurrent transactions can run. The behaviour both backends share is tested
on both in `test_store.py`."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from store import ConflictError, SessionEndedError, Store, turns_pg
from store.types import CompletionRecord
from tests.support.store_records import rec
from tests.support.store_statements import statements_of

pytestmark = pytest.mark.postgres


@pytest.fixture(scope="module")
def store_url(postgres_url: str) -> str:
    """These tests run on PostgreSQL alone (the shared `store` fixture connects to this)."""
    return postgres_url


async def test_a_batch_is_two_statements_and_a_session_one_to_make_and_one_to_end(
    store: Store,
) -> None:
    """Read what the batch depends on, write it guarded: two statements for one turn or a group
    of 16, when nothing raced them; a session is one INSERT to make and one UPDATE to end."""
    run = await store.create_run("pg-statements", {})
    with statements_of(store) as statements:
        (made,) = await store.create_sessions(run.id, 1)
        assert len(statements) == 1, statements
        sid = made.info.id
        statements.clear()
        await store.record_completions(
            [rec(f"{sid}-0", sid, 0, prompt=[1, 2], prefix_len=0, output=[3], opens=True)]
        )
        assert len(statements) == 2, statements
        statements.clear()
        await store.record_completions(
            [rec(f"{sid}-1", sid, 0, prompt=[1, 2, 3, 4], prefix_len=3, output=[5])]
        )
        assert len(statements) == 2, statements
        statements.clear()
        assert (await store.end_session(sid)).ended_at is not None
        assert len(statements) == 1, statements
        statements.clear()
        group = [n.info.id for n in await store.create_sessions(run.id, 16)]
        statements.clear()
        await asyncio.gather(
            *(
                store.record_completions(
                    [rec(f"{g}-0", g, 0, prompt=[1], prefix_len=0, output=[2], opens=True)]
                )
                for g in group
            )
        )
        assert len(statements) % 2 == 0, statements
        assert len(statements) <= 2 * 4, statements
    assert (await store.session_detail(sid)).segments[0].tokens == [1, 2, 3, 4, 5]


async def test_what_asyncpg_writes_reads_back_through_sqlalchemy_as_it_was_given(
    store: Store,
) -> None:
    run = await store.create_run("pg-values", {})
    (made,) = await store.create_sessions(run.id, 1, group_id="g", metadata={"task": "ü", "n": 1})
    sid = made.info.id
    request = {"messages": [{"role": "user", "content": 'naïve 日本 \u2028 \\ "'}], "n": None}
    record = dataclasses.replace(
        rec(f"{sid}-0", sid, 0, prompt=[7, 8], prefix_len=0, output=[9, 10], opens=True),
        logprobs=[-0.5, -1.25],
        versions=[3, 4],
        request=request,
        response={"choices": [{"text": "ok", "logprob": -1e-9}]},
        sampling={"temperature": 0.7, "stop": ["\n"]},
        transcript={"messages": [{"role": "assistant", "content": "é"}], "tools": []},
        ttft_ms=None,
        latency_ms=12.5,
    )
    await store.record_completions([record])
    turn = await store.get_turn(record.id)
    assert turn is not None
    assert turn.request == request
    assert turn.response == record.response
    (segment,) = await store.load_segments(sid)
    assert segment.tokens == [7, 8, 9, 10]
    assert segment.transcript == record.transcript
    ended = await store.end_session(sid)
    assert ended.metadata == {"task": "ü", "n": 1}
    assert ended.group_id == "g"
    assert ended.created_at.tzinfo is not None
    assert ended.ended_at is not None
    again = await store.end_session(sid)  # an ended session is read, not ended again
    assert again.ended_at == ended.ended_at


async def test_a_segment_id_a_concurrent_batch_took_is_a_conflict_not_a_driver_error(
    store: Store,
) -> None:
    """Two sessions' batches open the same segment id at once: neither sees the other's
    uncommitted row, so the second waits on the unique index and, when the first commits,
    gets ConflictError (asyncpg's UniqueViolationError never reaches the caller)."""
    run = await store.create_run("pg-race", {})
    a, b = (n.info.id for n in await store.create_sessions(run.id, 2))
    first, second = (
        dataclasses.replace(
            rec(f"{sid}-0", sid, 0, prompt=[1], prefix_len=0, output=[2], opens=True),
            segment_id="seg-shared",
        )
        for sid in (a, b)
    )
    db = store._db
    async with db.pg_transaction() as conn:
        await turns_pg.write_records(conn, [first])
        racing = asyncio.create_task(_write_alone(store, second))
        await asyncio.sleep(0.5)
        assert not racing.done()  # waiting on the first batch's unique index entry
    with pytest.raises(ConflictError, match="recorded meanwhile"):
        await racing
    assert [s.tokens for s in await store.load_segments(a)] == [[1, 2]]
    assert await store.load_segments(b) == []


async def _write_alone(store: Store, record: CompletionRecord) -> None:
    async with store._db.pg_transaction() as conn:
        await turns_pg.write_records(conn, [record])


async def test_a_turn_raced_by_its_sessions_end_is_refused_not_recorded(store: Store) -> None:
    """The optimistic write read the session as active; it ended before the write ran. The
    guard undoes the write and the locked path says the session ended."""
    run = await store.create_run("pg-end-race", {})
    (made,) = await store.create_sessions(run.id, 1)
    sid = made.info.id
    turn = rec(f"{sid}-0", sid, 0, prompt=[1], prefix_len=0, output=[2], opens=True)
    async with store._db.pg_transaction() as conn:
        await conn.execute("UPDATE sessions SET ended_at = now() WHERE id = $1", sid)
        racing = asyncio.create_task(store.record_completions([turn]))
        await asyncio.sleep(0.5)
        assert not racing.done()  # its write waits on the ending transaction's row lock
    with pytest.raises(SessionEndedError):
        await racing
    assert await store.load_segments(sid) == []
    assert await store.session_turns(sid) == 0


async def test_two_turns_from_one_prefix_at_once_one_lands_the_other_conflicts(
    store: Store,
) -> None:
    """Two gateways extend one segment from the same prefix at once: the second's optimistic
    write is undone and the locked path refuses it; the segment stays one exact chain of the
    first's tokens."""
    run = await store.create_run("pg-extend-race", {})
    (made,) = await store.create_sessions(run.id, 1)
    sid = made.info.id
    await store.record_completions(
        [rec(f"{sid}-0", sid, 0, prompt=[1], prefix_len=0, output=[2], opens=True)]
    )
    first = rec(f"{sid}-a", sid, 0, prompt=[1, 2, 3], prefix_len=2, output=[4])
    second = rec(f"{sid}-b", sid, 0, prompt=[1, 2, 5], prefix_len=2, output=[6])
    async with store._db.pg_transaction() as conn:
        await turns_pg.write_records(conn, [first])
        racing = asyncio.create_task(store.record_completions([second]))
        await asyncio.sleep(0.5)
        assert not racing.done()  # its guarded write waits on the first's row lock
    with pytest.raises(ConflictError, match="prefix_len is 2 but segment"):
        await racing
    (segment,) = await store.load_segments(sid)
    assert segment.tokens == [1, 2, 3, 4]
    assert await store.session_turns(sid) == 2
