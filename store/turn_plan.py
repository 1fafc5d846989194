"""What recording a batch of turns writes, as a pure function of the batch and what it read.

`store.turns` (SQLAlchemy Core, SQLite) and `store.turns_pg` (asyncpg, PostgreSQL) read the same
four things in the batch's transaction (its sessions, locked; the completion ids already taken;
the stored segments it may touch; the turns it replaces), and `plan_writes` decides from them,
without the database, what to write or which error to raise: a segment is never extended from a
stale prefix, an ended session takes no turn, a replaced turn must be its segment's last. The two
paths then write the plan, each with a fixed number of set-based statements.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from store.arrays import encode_f32, encode_i32
from store.errors import ConflictError, NotFoundError, SessionEndedError
from store.sessions import session_not_found
from store.types import JSON, CompletionRecord, TurnStatus


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


# what the batch's transaction read


@dataclass(frozen=True, slots=True)
class ClaimedSession:
    """A session of the batch, as read under its row lock."""

    id: str
    turn_count: int
    prefix_breaks: int
    ended_at: datetime | None


@dataclass(frozen=True, slots=True)
class StoredSegment:
    id: str
    session_id: str
    position: int
    length: int


@dataclass(frozen=True, slots=True)
class ReplacedTurn:
    """A stored turn that a record of the batch replaces."""

    id: str
    segment_id: str
    prefix_len: int
    end: int
    """The segment's length right after this turn."""
    status: str


@dataclass(frozen=True, slots=True)
class TurnReads:
    sessions: dict[str, ClaimedSession]
    taken: list[str]
    """Completion ids of the batch that are already recorded."""
    segments: list[StoredSegment]
    """Every stored segment of the batch's sessions, and any holding an id the batch opens."""
    replaced: dict[str, ReplacedTurn]


def session_ids(records: list[CompletionRecord]) -> list[str]:
    """The batch's sessions in id order: the order their rows are locked in, so concurrent
    batches lock in one order."""
    return sorted({r.session_id for r in records})


def opened_segment_ids(records: list[CompletionRecord]) -> list[str]:
    return sorted({r.segment_id for r in records if r.opens_segment})


def replaced_ids(records: list[CompletionRecord]) -> list[str]:
    return sorted(r.replaces for r in records if r.replaces is not None)


# what it writes


@dataclass(slots=True)
class Segment:
    id: str
    session_id: str
    position: int
    stored_length: int | None
    """The length in the database before this batch; None for a segment this batch opens."""
    length: int
    transcript: JSON


@dataclass(frozen=True, slots=True)
class SessionTurns:
    id: str
    turn_count: int
    prefix_breaks: int
    read_turn_count: int
    """The turn count read: the session is updated only from it (PostgreSQL's optimistic write)."""


@dataclass(frozen=True, slots=True)
class TurnWrites:
    sessions: list[SessionTurns]
    """Each session's new turn and prefix-break counts."""
    opened: list[Segment]
    extended: list[Segment]
    """Segments to move from `stored_length` to `length`, with their new transcripts."""
    replaced: list[str]
    """Completion ids to mark replaced."""
    completions: list[dict[str, Any]]
    """The completions' rows, by column name."""


def plan_writes(records: list[CompletionRecord], reads: TurnReads, now: datetime) -> TurnWrites:
    """The writes that record `records` (checked) given what their transaction read; raises
    NotFoundError, SessionEndedError or ConflictError, in that order of precedence, instead."""
    turns = _session_turns(records, reads.sessions)
    if reads.taken:
        raise ConflictError(f"completion ids already recorded: {reads.taken}; ids must be unique")
    by_id = {row.id: row for row in reads.segments}
    by_position = {(row.session_id, row.position): row for row in reads.segments}
    next_turn = {sid: reads.sessions[sid].turn_count for sid in reads.sessions}
    segments: dict[str, Segment] = {}
    rows: list[dict[str, Any]] = []
    for record in records:
        segment = _segment_for(record, segments.get(record.segment_id), by_id, by_position)
        segments[segment.id] = segment
        if record.replaces is not None:
            _rewind(record, segment, reads.replaced)
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
    return TurnWrites(
        sessions=turns,
        opened=[seg for seg in segments.values() if seg.stored_length is None],
        extended=[seg for seg in segments.values() if seg.stored_length is not None],
        replaced=replaced_ids(records),
        completions=rows,
    )


def _session_turns(
    records: list[CompletionRecord], found: dict[str, ClaimedSession]
) -> list[SessionTurns]:
    per_session = Counter(r.session_id for r in records)
    breaks = Counter(r.session_id for r in records if r.prefix_break and r.side is None)
    out = []
    for session_id in session_ids(records):
        row = found.get(session_id)
        if row is None:
            raise session_not_found(session_id)
        if row.ended_at is not None:
            raise SessionEndedError(
                f"session {session_id!r} has ended: no more turns can be recorded; "
                "create a new session to continue"
            )
        out.append(
            SessionTurns(
                session_id,
                row.turn_count + per_session[session_id],
                row.prefix_breaks + breaks[session_id],
                row.turn_count,
            )
        )
    return out


def _rewind(record: CompletionRecord, segment: Segment, replaced: dict[str, ReplacedTurn]) -> None:
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


def _segment_for(
    record: CompletionRecord,
    seen: Segment | None,
    by_id: dict[str, StoredSegment],
    by_position: dict[tuple[str, int], StoredSegment],
) -> Segment:
    """The segment `record` writes into: opened by it, seen earlier in the batch, or stored."""
    if record.opens_segment:
        if seen is not None:
            raise ConflictError(f"segment {record.segment_id!r} is opened twice in one batch")
        clash = by_id.get(record.segment_id) or by_position.get(
            (record.session_id, record.segment_index)
        )
        if clash is not None:
            raise ConflictError(
                f"session {record.session_id!r} already has segment {clash.id!r} (id "
                f"{record.segment_id!r} or index {record.segment_index} is taken): reload the "
                "session's segments and open the next index"
            )
        return Segment(
            id=record.segment_id,
            session_id=record.session_id,
            position=record.segment_index,
            stored_length=None,
            length=0,
            transcript=record.transcript,
        )
    segment = seen
    if segment is None:
        row = by_id.get(record.segment_id)
        if row is not None:
            segment = Segment(
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


COMPLETION_COLUMNS = (
    "id",
    "session_id",
    "segment_id",
    "turn",
    "prefix_len",
    "prompt_delta",
    "output_ids",
    "logprobs",
    "versions",
    "min_version",
    "max_version",
    "finish_reason",
    "status",
    "side",
    "sampling",
    "request",
    "response",
    "latency_ms",
    "ttft_ms",
    "created_at",
)
"""The columns of a completion's row, in the order `_completion_row` fills them."""


def _completion_row(
    record: CompletionRecord, delta: list[int], turn: int, now: datetime
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
