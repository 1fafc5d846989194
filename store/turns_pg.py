"""Recording turns on PostgreSQL through asyncpg itself: the same plan as `store.turns`
(`store.turn_plan`), in two statements whatever the batch holds.

The hot path of every turn of every agent, so written against the driver: SQLAlchemy's statement
machinery and greenlet hops cost more client CPU per turn than PostgreSQL spent on it
(BENCHMARKS.md, "Store"). Optimistic first, each statement committed on its own:

1. one read, without locks: the batch's sessions (turn counts, ended or not), its completion
   ids already taken, and the stored segments it may touch;
2. one statement writes the plan: the sessions' turn counts, the opened segments, the extended
   ones, the replaced turns' marks and the completions, as data-modifying CTEs over arrays
   (`unnest`), so the statement is the same for any batch. Each session is updated only from
   the turn count read and only while active, each segment only from the length read; if any
   changed meanwhile (another gateway recorded a turn of the session, or ended it), the guard
   (`rlgateway_turns_guard`, migration 0008) fails the statement and nothing of it is written.

Then, and when the plan refuses the batch or an id it opens was taken meanwhile, the batch is
written again in a transaction that first locks its sessions' rows in id order (concurrent
batches lock in one order), reads after the lock (under READ COMMITTED each statement sees what
committed before it started) and runs the same write, whose guards then hold: this path decides
every error a caller sees. A batch is two statements when nothing raced it, five when something
did.
"""

from __future__ import annotations

import json
import re
from typing import Any

import asyncpg
from sqlalchemy import JSON
from sqlalchemy.dialects.postgresql.base import PGDialect

from store.db import Database, utcnow
from store.errors import ConflictError, StoreError
from store.tables import CompletionRow
from store.turn_plan import (
    COMPLETION_COLUMNS,
    ClaimedSession,
    ReplacedTurn,
    StoredSegment,
    TurnReads,
    TurnWrites,
    opened_segment_ids,
    plan_writes,
    replaced_ids,
    session_ids,
)
from store.types import CompletionRecord, TurnStatus

_LOCK_SESSIONS = "SELECT id FROM sessions WHERE id = ANY($1::varchar[]) ORDER BY id FOR UPDATE"
_SESSION, _TAKEN, _SEGMENT = 0, 1, 2
_READ = f"""
SELECT {_SESSION} AS kind, id, NULL::varchar AS session_id, turn_count AS a, prefix_breaks AS b,
       ended_at
FROM sessions WHERE id = ANY($1::varchar[])
UNION ALL
SELECT {_TAKEN}, id, NULL, NULL, NULL, NULL FROM completions WHERE id = ANY($2::varchar[])
UNION ALL
SELECT {_SEGMENT}, id, session_id, position, length, NULL FROM segments
WHERE session_id = ANY($1::varchar[]) OR id = ANY($3::varchar[])
"""
STALE = "RLG01"
"""The guard's SQLSTATE: a session or segment changed since the batch read it."""
_REPLACED_TURNS = """
SELECT id, segment_id, prefix_len, status,
       (octet_length(prompt_delta) + octet_length(output_ids)) / 4 AS tokens
FROM completions WHERE id = ANY($1::varchar[])
"""
_COMPLETIONS = CompletionRow.__table__.c
_PG = PGDialect()  # type: ignore[no-untyped-call]
_JSON_COLUMNS = frozenset(c for c in COMPLETION_COLUMNS if isinstance(_COMPLETIONS[c].type, JSON))
_COMPLETION_TYPES = {
    # the column's own PostgreSQL type, without a length: a cast to varchar(n) would cut a longer
    # value where the insert refuses it
    c: re.sub(r"\(\d+\)", "", _COMPLETIONS[c].type.compile(dialect=_PG))
    for c in COMPLETION_COLUMNS
}
_C = 11  # the completions' parameters start at $12
_COMPLETION_ARRAYS = ", ".join(
    f"${_C + 1 + i}::{_COMPLETION_TYPES[c]}[]" for i, c in enumerate(COMPLETION_COLUMNS)
)
_WRITE = f"""
WITH turns AS (
    UPDATE sessions AS s SET turn_count = u.turns, prefix_breaks = u.breaks
    FROM unnest($1::varchar[], $2::int[], $3::int[], $10::int[]) AS u(id, turns, breaks, read)
    WHERE s.id = u.id AND s.turn_count = u.read AND s.ended_at IS NULL
    RETURNING 1
), opened AS (
    INSERT INTO segments (id, session_id, position, transcript, length, created_at)
    SELECT u.id, u.session_id, u.position, u.transcript, u.length, $4::timestamptz
    FROM unnest($5::varchar[], $6::varchar[], $7::int[], $8::json[], $9::int[])
        AS u(id, session_id, position, transcript, length)
    RETURNING 1
), extended AS (
    UPDATE segments AS g SET length = u.length, transcript = u.transcript
    FROM unnest(${_C + 21}::varchar[], ${_C + 22}::int[], ${_C + 23}::int[], ${_C + 24}::json[])
        AS u(id, stored, length, transcript)
    WHERE g.id = u.id AND g.length = u.stored
    RETURNING 1
), replaced AS (
    UPDATE completions SET status = '{TurnStatus.REPLACED.value}'
    WHERE id = ANY($11::varchar[])
    RETURNING 1
), added AS (
    INSERT INTO completions ({", ".join(COMPLETION_COLUMNS)})
    SELECT * FROM unnest({_COMPLETION_ARRAYS})
    RETURNING 1
)
SELECT rlgateway_turns_guard(
    cardinality($1::varchar[]), (SELECT count(*) FROM turns),
    cardinality(${_C + 21}::varchar[]), (SELECT count(*) FROM extended)
)
"""


async def write_batch(db: Database, records: list[CompletionRecord]) -> None:
    """Record checked `records` on `db`: optimistically in two statements, or, when that was
    raced or refused, under their sessions' locks (which raises what the caller must hear)."""
    async with db.pg_connection() as conn:
        try:
            now = utcnow()
            plan = plan_writes(records, await _reads(conn, records), now)
            await conn.fetchval(_WRITE, *_write_args(plan, now))
            return
        except (
            StoreError,
            asyncpg.IntegrityConstraintViolationError,
            asyncpg.DeadlockDetectedError,
        ):
            pass  # a refusal from unlocked reads, or a race: decided under the locks
        except asyncpg.PostgresError as exc:
            if exc.sqlstate != STALE:
                raise
        async with conn.transaction():
            await write_records(conn, records)


async def write_records(conn: asyncpg.Connection, records: list[CompletionRecord]) -> None:
    """The writes of `record_completions` (checked records) in the caller's transaction on
    `conn`, under the sessions' row locks; raises as `plan_writes` says, and ConflictError for
    a completion or segment id that another transaction took meanwhile."""
    await conn.execute(_LOCK_SESSIONS, session_ids(records))
    now = utcnow()
    plan = plan_writes(records, await _reads(conn, records), now)
    try:
        await conn.fetchval(_WRITE, *_write_args(plan, now))
    except asyncpg.UniqueViolationError as exc:
        raise ConflictError(
            f"a completion or segment id of this batch was recorded meanwhile ({exc.detail}); "
            "ids must be unique: reload the session's segments"
        ) from exc


async def _reads(conn: asyncpg.Connection, records: list[CompletionRecord]) -> TurnReads:
    found: dict[str, ClaimedSession] = {}
    taken: list[str] = []
    segments: list[StoredSegment] = []
    ids = [r.id for r in records]
    for row in await conn.fetch(_READ, session_ids(records), ids, opened_segment_ids(records)):
        kind, id_ = row["kind"], row["id"]
        if kind == _SESSION:
            found[id_] = ClaimedSession(id_, row["a"], row["b"], row["ended_at"])
        elif kind == _TAKEN:
            taken.append(id_)
        else:
            segments.append(StoredSegment(id_, row["session_id"], row["a"], row["b"]))
    replaced: dict[str, ReplacedTurn] = {}
    if wanted := replaced_ids(records):
        replaced = {
            row["id"]: ReplacedTurn(
                row["id"],
                row["segment_id"],
                row["prefix_len"],
                row["prefix_len"] + row["tokens"],
                row["status"],
            )
            for row in await conn.fetch(_REPLACED_TURNS, wanted)
        }
    return TurnReads(found, taken, segments, replaced)


def _write_args(plan: TurnWrites, now: Any) -> list[Any]:
    columns: list[list[Any]] = [[] for _ in COMPLETION_COLUMNS]
    for row in plan.completions:
        for column, name in zip(columns, COMPLETION_COLUMNS, strict=True):
            value = row[name]
            column.append(json.dumps(value) if name in _JSON_COLUMNS else value)
    return [
        [t.id for t in plan.sessions],
        [t.turn_count for t in plan.sessions],
        [t.prefix_breaks for t in plan.sessions],
        now,
        [seg.id for seg in plan.opened],
        [seg.session_id for seg in plan.opened],
        [seg.position for seg in plan.opened],
        [json.dumps(seg.transcript) for seg in plan.opened],
        [seg.length for seg in plan.opened],
        [t.read_turn_count for t in plan.sessions],
        plan.replaced,
        *columns,
        [seg.id for seg in plan.extended],
        [seg.stored_length for seg in plan.extended],
        [seg.length for seg in plan.extended],
        [json.dumps(seg.transcript) for seg in plan.extended],
    ]
