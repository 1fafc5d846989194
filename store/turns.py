"""Recording turns (completions) into segments, and reading a session's segments back.

A turn is stored as its prompt delta plus its sampled arrays; the segment is the concatenation
of its turns. `record_completions` writes a whole batch (the n choices of one request) in one
transaction and checks each turn against the segment's current length, so a segment is never
left half-extended or extended from a stale prefix. A turn that `replaces` its segment's last turn
(a retry of a reply the client never received) rewinds the segment to before that turn, which is
kept, marked replaced, outside the segment.

This is the gateway's hot path (every response waits for it), so it is written as a few
set-based Core statements, built once at import (lists bind as expanding parameters) and run on a
plain Connection rather than through the ORM, and their number does not grow with the batch: a
group commit of 64 single-turn requests costs six statements and the commit, as one request does.
"""

from __future__ import annotations

from typing import Any, cast

from sqlalchemy import CursorResult, Table, bindparam, insert, or_, select, update
from sqlalchemy.engine import Connection

from store.arrays import decode_i32
from store.db import Database, utcnow
from store.sessions import session_not_found
from store.tables import CompletionRow, SegmentRow, SessionRow
from store.turn_plan import (
    ClaimedSession,
    ReplacedTurn,
    StoredSegment,
    TurnReads,
    check_records,
    opened_segment_ids,
    plan_writes,
    replaced_ids,
    session_ids,
)
from store.types import JSON, CompletionRecord, KeptTurn, LastTurn, SegmentState, TurnStatus


async def record_completions(db: Database, records: list[CompletionRecord]) -> None:
    """Commit every record or none. See `Store.record_completions`."""
    check_records(records)
    if records:
        await write_batch(db, records)


async def write_batch(db: Database, records: list[CompletionRecord]) -> None:
    """Record checked `records` (of one or many requests) in one transaction: all or none."""
    if db.dialect == "postgresql":
        from store import turns_pg  # asyncpg, imported on PostgreSQL only

        await turns_pg.write_batch(db, records)
    else:
        await db.write_sync(lambda conn: write_records(conn, records))


async def write_isolated(
    db: Database, batches: list[list[CompletionRecord]]
) -> list[BaseException | None]:
    """Record each batch in a SAVEPOINT of one transaction, so only the failing ones fail;
    each batch's error, or None. If the transaction itself fails, every batch hears it."""
    errors: list[BaseException | None] = [None] * len(batches)
    try:
        if db.dialect == "postgresql":
            from store import turns_pg

            async with db.pg_transaction() as conn:
                for i, records in enumerate(batches):
                    try:
                        async with conn.transaction():
                            await turns_pg.write_records(conn, records)
                    except Exception as exc:  # this batch's failure, isolated
                        errors[i] = exc
        else:

            def each_in_a_savepoint(s: Connection) -> None:
                for i, records in enumerate(batches):
                    try:
                        with s.begin_nested():
                            write_records(s, records)
                    except Exception as exc:  # this batch's failure, isolated
                        errors[i] = exc

            await db.write_sync(each_in_a_savepoint)
    except BaseException as exc:
        errors = [e or exc for e in errors]
    return errors


def write_records(s: Connection, records: list[CompletionRecord]) -> None:
    """The writes of `record_completions` inside the caller's transaction (checked records),
    through SQLAlchemy Core: at most seven statements however many records the batch holds (two
    more when some replace a turn). Synchronous, so that on SQLite a whole transaction is one
    call to the writer thread (`Database.write_sync`)."""
    now = utcnow()
    plan = plan_writes(records, _reads(s, records), now)
    s.execute(
        _CLAIM_TURNS,
        [{"_id": t.id, "_turns": t.turn_count, "_breaks": t.prefix_breaks} for t in plan.sessions],
    )
    if plan.opened:
        s.execute(
            insert(_SEGMENTS),
            [
                dict(
                    id=seg.id,
                    session_id=seg.session_id,
                    position=seg.position,
                    transcript=seg.transcript,
                    length=seg.length,
                    created_at=now,
                )
                for seg in plan.opened
            ],
        )
    if plan.extended:
        moved: CursorResult[Any] = s.execute(
            _EXTEND_SEGMENT,
            [
                {
                    "_id": seg.id,
                    "_stored": seg.stored_length,
                    "_length": seg.length,
                    "_transcript": seg.transcript,
                }
                for seg in plan.extended
            ],
        )
        if moved.supports_sane_multi_rowcount():
            assert moved.rowcount == len(plan.extended), "a segment changed under its lock"
    if plan.replaced:
        s.execute(_MARK_REPLACED, {"ids": plan.replaced})
    s.execute(insert(_COMPLETIONS), plan.completions)


def _reads(s: Connection, records: list[CompletionRecord]) -> TurnReads:
    sessions = session_ids(records)
    found = {
        row.id: ClaimedSession(row.id, row.turn_count, row.prefix_breaks, row.ended_at)
        for row in s.execute(_CLAIM_SESSIONS, {"ids": sessions})
    }
    taken = list(s.scalars(_TAKEN_IDS, {"ids": [r.id for r in records]}))
    opened = opened_segment_ids(records)
    if opened:
        stored = s.execute(_STORED_OF_SESSIONS_OR_IDS, {"sessions": sessions, "ids": opened})
    else:
        stored = s.execute(_STORED_OF_SESSIONS, {"sessions": sessions})
    segments = [StoredSegment(*row) for row in stored]
    replaced: dict[str, ReplacedTurn] = {}
    if ids := replaced_ids(records):
        replaced = {
            row.id: ReplacedTurn(
                row.id,
                row.segment_id,
                row.prefix_len,
                row.prefix_len + (len(row.prompt_delta) + len(row.output_ids)) // 4,
                row.status,
            )
            for row in s.execute(_REPLACED_TURNS, {"ids": ids})
        }
    return TurnReads(found, taken, segments, replaced)


_SESSIONS = cast(Table, SessionRow.__table__)
_SEGMENTS = cast(Table, SegmentRow.__table__)
_COMPLETIONS = cast(Table, CompletionRow.__table__)
# Core statements (no ORM unit of work), executed once per batch with one parameter set per row.
_CLAIM_TURNS = (
    update(_SESSIONS)
    .where(_SESSIONS.c.id == bindparam("_id"))
    .values(turn_count=bindparam("_turns"), prefix_breaks=bindparam("_breaks"))
)
_CLAIM_SESSIONS = (
    select(_SESSIONS.c.id, _SESSIONS.c.turn_count, _SESSIONS.c.prefix_breaks, _SESSIONS.c.ended_at)
    .where(_SESSIONS.c.id.in_(bindparam("ids", expanding=True)))
    .order_by(_SESSIONS.c.id)
    .with_for_update()
)
_TAKEN_IDS = select(_COMPLETIONS.c.id).where(
    _COMPLETIONS.c.id.in_(bindparam("ids", expanding=True))
)
_STORED_COLUMNS = (
    _SEGMENTS.c.id,
    _SEGMENTS.c.session_id,
    _SEGMENTS.c.position,
    _SEGMENTS.c.length,
)
_STORED_OF_SESSIONS = select(*_STORED_COLUMNS).where(
    _SEGMENTS.c.session_id.in_(bindparam("sessions", expanding=True))
)
_STORED_OF_SESSIONS_OR_IDS = select(*_STORED_COLUMNS).where(
    or_(
        _SEGMENTS.c.session_id.in_(bindparam("sessions", expanding=True)),
        _SEGMENTS.c.id.in_(bindparam("ids", expanding=True)),
    )
)
_EXTEND_SEGMENT = (
    update(_SEGMENTS)
    .where(_SEGMENTS.c.id == bindparam("_id"), _SEGMENTS.c.length == bindparam("_stored"))
    .values(
        length=bindparam("_length"),
        transcript=bindparam("_transcript", type_=_SEGMENTS.c.transcript.type),
    )
)


_REPLACED_TURNS = select(
    _COMPLETIONS.c.id,
    _COMPLETIONS.c.segment_id,
    _COMPLETIONS.c.prefix_len,
    _COMPLETIONS.c.status,
    _COMPLETIONS.c.prompt_delta,
    _COMPLETIONS.c.output_ids,
).where(_COMPLETIONS.c.id.in_(bindparam("ids", expanding=True)))
_MARK_REPLACED = (
    update(_COMPLETIONS)
    .where(_COMPLETIONS.c.id.in_(bindparam("ids", expanding=True)))
    .values(status=TurnStatus.REPLACED.value)
)


async def get_turn(db: Database, completion_id: str) -> KeptTurn | None:
    """The recorded turn of this completion id, or None."""
    async with db.read() as s:
        row = (
            await s.execute(
                select(
                    CompletionRow.session_id,
                    CompletionRow.status,
                    CompletionRow.request,
                    CompletionRow.response,
                ).where(CompletionRow.id == completion_id)
            )
        ).first()
    if row is None:
        return None
    session_id, status, request, response = row
    return KeptTurn(completion_id, session_id, TurnStatus(status), request, response)


async def load_segments(db: Database, session_id: str) -> list[SegmentState]:
    """The session's segments in index order, each with its exact token list."""
    async with db.read() as s:
        if await s.get(SessionRow, session_id) is None:
            raise session_not_found(session_id)
        segments = list(
            await s.scalars(
                select(SegmentRow)
                .where(SegmentRow.session_id == session_id)
                .order_by(SegmentRow.position)
            )
        )
        parts = await s.execute(
            select(
                CompletionRow.id,
                CompletionRow.segment_id,
                CompletionRow.status,
                CompletionRow.prefix_len,
                CompletionRow.prompt_delta,
                CompletionRow.output_ids,
            )
            .where(
                CompletionRow.session_id == session_id,
                CompletionRow.status != TurnStatus.REPLACED.value,
            )
            .order_by(CompletionRow.turn)
        )
        tokens: dict[str, list[int]] = {seg.id: [] for seg in segments}
        last: dict[str, tuple[str, TurnStatus, int, int]] = {}
        for cid, segment_id, status, prefix_len, delta, output in parts:
            tokens[segment_id] += decode_i32(delta)
            prompt_len = len(tokens[segment_id])
            tokens[segment_id] += decode_i32(output)
            last[segment_id] = (cid, TurnStatus(status), prefix_len, prompt_len)
        requests: dict[str, JSON] = {}
        if last:
            found = await s.execute(
                select(CompletionRow.id, CompletionRow.request).where(
                    CompletionRow.id.in_([t[0] for t in last.values()])
                )
            )
            requests = {cid: request for cid, request in found}
    for seg in segments:
        assert len(tokens[seg.id]) == seg.length, f"segment {seg.id} lost tokens"

    def last_turn(segment_id: str) -> LastTurn | None:
        if segment_id not in last:
            return None
        cid, status, prefix_len, prompt_len = last[segment_id]
        return LastTurn(cid, status, prefix_len, prompt_len, requests[cid])

    return [
        SegmentState(
            id=seg.id,
            index=seg.position,
            transcript=seg.transcript,
            tokens=tokens[seg.id],
            last_turn=last_turn(seg.id),
        )
        for seg in segments
    ]
