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

from collections import Counter
from dataclasses import dataclass
from typing import Any, cast

from sqlalchemy import CursorResult, Table, bindparam, insert, or_, select, update
from sqlalchemy.engine import Connection

from store.arrays import decode_i32, encode_f32, encode_i32
from store.db import Database, utcnow
from store.errors import ConflictError, NotFoundError, SessionEndedError
from store.sessions import session_not_found
from store.tables import CompletionRow, SegmentRow, SessionRow
from store.types import JSON, CompletionRecord, KeptTurn, LastTurn, SegmentState, TurnStatus


def _check(record: CompletionRecord) -> None:
    n = len(record.output_ids)
    if len(record.logprobs) != n or len(record.versions) != n:
        raise ValueError(
            f"completion {record.id!r}: output_ids, logprobs and versions must share one length "
            f"(got {n}, {len(record.logprobs)}, {len(record.versions)})"
        )
    if not 0 <= record.prefix_len <= len(record.prompt_ids):
        raise ValueError(
            f"completion {record.id!r}: prefix_len {record.prefix_len} must lie in "
            f"[0, len(prompt_ids) = {len(record.prompt_ids)}]"
        )
    if record.segment_index < 0:
        raise ValueError(f"completion {record.id!r}: segment_index must be >= 0")
    if record.replaces is not None and record.opens_segment:
        raise ValueError(f"completion {record.id!r}: a turn that opens a segment replaces none")


@dataclass(slots=True)
class _Segment:
    id: str
    session_id: str
    position: int
    stored_length: int | None
    """The length in the database before this batch; None for a segment this batch opens."""
    length: int
    transcript: JSON


def check_records(records: list[CompletionRecord]) -> None:
    """The checks that need no database (ValueError)."""
    for record in records:
        _check(record)
    ids = [r.id for r in records]
    if len(set(ids)) != len(ids):
        raise ValueError(f"completion ids in one batch must be distinct, got {ids}")
    replaced = [r.replaces for r in records if r.replaces is not None]
    if len(set(replaced)) != len(replaced):
        raise ValueError(f"a turn can be replaced once, got {replaced}")


async def record_completions(db: Database, records: list[CompletionRecord]) -> None:
    """Commit every record or none. See `Store.record_completions`."""
    check_records(records)
    if not records:
        return
    await db.write_sync(lambda conn: write_records(conn, records))


def write_records(s: Connection, records: list[CompletionRecord]) -> None:
    """The writes of `record_completions` inside the caller's transaction (checked records).

    The records may span many requests and sessions (the group committer passes a whole group):
    the statements are set-based, at most seven per call however many records it holds (two more
    when some replace a turn). It is synchronous so that on SQLite a whole transaction is one
    call to the writer thread (`Database.write_sync`).
    """
    ids = [r.id for r in records]
    now = utcnow()
    next_turn = _claim_turns(s, records)
    taken = list(s.scalars(_TAKEN_IDS, {"ids": ids}))
    if taken:
        raise ConflictError(f"completion ids already recorded: {taken}; ids must be unique")

    stored = _stored_segments(s, records)
    replaced = _replaced_turns(s, records)
    segments: dict[str, _Segment] = {}
    rows: list[dict[str, Any]] = []
    for record in records:
        segment = _segment_for(record, segments.get(record.segment_id), stored)
        segments[segment.id] = segment
        if record.replaces is not None:
            _rewind(record, segment, replaced)
        if record.prefix_len != segment.length:
            raise ConflictError(
                f"completion {record.id!r}: prefix_len is {record.prefix_len} but segment "
                f"{segment.id!r} holds {segment.length} tokens (another turn extended it "
                "meanwhile); reload the session's segments and start a new segment"
            )
        delta = record.prompt_ids[record.prefix_len :]
        segment.length += len(delta) + len(record.output_ids)
        segment.transcript = record.transcript
        rows.append(_completion_row(record, delta, next_turn[record.session_id], now))
        next_turn[record.session_id] += 1

    opened = [seg for seg in segments.values() if seg.stored_length is None]
    if opened:
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
                for seg in opened
            ],
        )
    extended = [seg for seg in segments.values() if seg.stored_length is not None]
    if extended:
        moved: CursorResult[Any] = s.execute(
            _EXTEND_SEGMENT,
            [
                {
                    "_id": seg.id,
                    "_stored": seg.stored_length,
                    "_length": seg.length,
                    "_transcript": seg.transcript,
                }
                for seg in extended
            ],
        )
        if moved.supports_sane_multi_rowcount():
            assert moved.rowcount == len(extended), "a segment changed under its session's lock"
    if replaced:
        s.execute(_MARK_REPLACED, {"ids": sorted(replaced)})
    s.execute(insert(_COMPLETIONS), rows)


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


@dataclass(frozen=True, slots=True)
class _Replaced:
    segment_id: str
    prefix_len: int
    end: int
    """The segment's length right after this turn."""
    status: str


def _replaced_turns(s: Connection, records: list[CompletionRecord]) -> dict[str, _Replaced]:
    ids = sorted(r.replaces for r in records if r.replaces is not None)
    if not ids:
        return {}
    return {
        row.id: _Replaced(
            row.segment_id,
            row.prefix_len,
            row.prefix_len + (len(row.prompt_delta) + len(row.output_ids)) // 4,
            row.status,
        )
        for row in s.execute(_REPLACED_TURNS, {"ids": ids})
    }


def _rewind(record: CompletionRecord, segment: _Segment, replaced: dict[str, _Replaced]) -> None:
    """Take the replaced turn out of `segment`: it must be the segment's last turn."""
    old = replaced.get(record.replaces or "")
    if (
        old is None
        or old.segment_id != segment.id
        or old.status == TurnStatus.REPLACED.value
        or old.end != segment.length
    ):
        raise ConflictError(
            f"completion {record.id!r} replaces {record.replaces!r}, which is not the last turn of "
            f"segment {segment.id!r}: reload the session's segments"
        )
    segment.length = old.prefix_len


def _claim_turns(s: Connection, records: list[CompletionRecord]) -> dict[str, int]:
    """Lock the records' sessions and take their next turn numbers; returns each session's
    first new turn. The sessions are locked (`FOR UPDATE` on PostgreSQL; SQLite's write
    transaction locks the database) in id order, so concurrent batches lock in one order."""
    per_session = Counter(r.session_id for r in records)
    breaks = Counter(r.session_id for r in records if r.prefix_break and r.side is None)
    session_ids = sorted(per_session)
    found = {row.id: row for row in s.execute(_CLAIM_SESSIONS, {"ids": session_ids})}
    for session_id in session_ids:
        row = found.get(session_id)
        if row is None:
            raise session_not_found(session_id)
        if row.ended_at is not None:
            raise SessionEndedError(
                f"session {session_id!r} has ended: no more turns can be recorded; "
                "create a new session to continue"
            )
    s.execute(
        _CLAIM_TURNS,
        [
            {
                "_id": sid,
                "_turns": found[sid].turn_count + per_session[sid],
                "_breaks": found[sid].prefix_breaks + breaks[sid],
            }
            for sid in session_ids
        ],
    )
    return {sid: found[sid].turn_count for sid in session_ids}


@dataclass(frozen=True, slots=True)
class _Stored:
    id: str
    session_id: str
    position: int
    length: int


@dataclass(slots=True)
class _StoredSegments:
    by_id: dict[str, _Stored]
    by_position: dict[tuple[str, int], _Stored]


def _stored_segments(s: Connection, records: list[CompletionRecord]) -> _StoredSegments:
    """Every stored segment the records may touch or clash with: those of their sessions, and
    any holding an id that a record opens. One indexed query."""
    session_ids = sorted({r.session_id for r in records})
    opened_ids = sorted({r.segment_id for r in records if r.opens_segment})
    if opened_ids:
        result = s.execute(_STORED_OF_SESSIONS_OR_IDS, {"sessions": session_ids, "ids": opened_ids})
    else:
        result = s.execute(_STORED_OF_SESSIONS, {"sessions": session_ids})
    rows = [_Stored(*row) for row in result]
    return _StoredSegments(
        by_id={row.id: row for row in rows},
        by_position={(row.session_id, row.position): row for row in rows},
    )


def _segment_for(
    record: CompletionRecord, seen: _Segment | None, stored: _StoredSegments
) -> _Segment:
    """The segment `record` writes into: opened by it, seen earlier in the batch, or stored."""
    if record.opens_segment:
        if seen is not None:
            raise ConflictError(f"segment {record.segment_id!r} is opened twice in one batch")
        clash = stored.by_id.get(record.segment_id) or stored.by_position.get(
            (record.session_id, record.segment_index)
        )
        if clash is not None:
            raise ConflictError(
                f"session {record.session_id!r} already has segment {clash.id!r} (id "
                f"{record.segment_id!r} or index {record.segment_index} is taken): reload the "
                "session's segments and open the next index"
            )
        return _Segment(
            id=record.segment_id,
            session_id=record.session_id,
            position=record.segment_index,
            stored_length=None,
            length=0,
            transcript=record.transcript,
        )
    segment = seen
    if segment is None:
        row = stored.by_id.get(record.segment_id)
        if row is not None:
            segment = _Segment(
                id=row.id,
                session_id=row.session_id,
                position=row.position,
                stored_length=row.length,
                length=row.length,
                transcript={},
            )
    if (
        segment is None
        or segment.session_id != record.session_id
        or segment.position != record.segment_index
    ):
        raise NotFoundError(
            f"session {record.session_id!r} has no segment {record.segment_id!r} at index "
            f"{record.segment_index}: open it with opens_segment=True"
        )
    return segment


def _completion_row(
    record: CompletionRecord, delta: list[int], turn: int, now: Any
) -> dict[str, Any]:
    return dict(
        id=record.id,
        session_id=record.session_id,
        segment_id=record.segment_id,
        turn=turn,
        prefix_len=record.prefix_len,
        prompt_delta=encode_i32(delta),
        output_ids=encode_i32(record.output_ids),
        logprobs=encode_f32(record.logprobs),
        versions=encode_i32(record.versions),
        min_version=min(record.versions, default=None),
        max_version=max(record.versions, default=None),
        finish_reason=record.finish_reason,
        status=record.status.value,
        side=record.side,
        sampling=record.sampling,
        request=record.request,
        response=record.response,
        latency_ms=record.latency_ms,
        ttft_ms=record.ttft_ms,
        created_at=now,
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
