"""Recording turns on PostgreSQL through asyncpg itself: the same plan as `store.turns`
(`store.turn_plan`), in three statements whatever the batch holds.

The hot path of every turn of every agent, so written against the driver: SQLAlchemy's statement
machinery and greenlet hops cost more client CPU per turn than PostgreSQL spent on it
(BENCHMARKS.md, "Store"). In the batch's transaction:

1. its sessions' rows are locked in id order (`FOR UPDATE`; concurrent batches lock in one order);
2. one read, after the lock (under READ COMMITTED each statement sees what committed before it
   started, so a batch that waited for the lock sees the turns recorded meanwhile): the batch's
   completion ids already taken, and the stored segments it may touch;
3. one statement writes the plan: the sessions' turn counts, the opened segments, the extended
   ones (each only from its stored length), the replaced turns' marks and the completions, as
   data-modifying CTEs over arrays (`unnest`), so the statement is the same for any batch.
"""

from __future__ import annotations

import json
from typing import Any

import asyncpg

from store.db import utcnow
from store.errors import ConflictError
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

_LOCK_SESSIONS = """
SELECT id, turn_count, prefix_breaks, ended_at FROM sessions
WHERE id = ANY($1::varchar[]) ORDER BY id FOR UPDATE
"""
_TAKEN_AND_STORED = """
SELECT true AS taken, id, NULL::varchar AS session_id, NULL::int AS position, NULL::int AS length
FROM completions WHERE id = ANY($1::varchar[])
UNION ALL
SELECT false, id, session_id, position, length FROM segments
WHERE session_id = ANY($2::varchar[]) OR id = ANY($3::varchar[])
"""
_REPLACED_TURNS = """
SELECT id, segment_id, prefix_len, status,
       (octet_length(prompt_delta) + octet_length(output_ids)) / 4 AS tokens
FROM completions WHERE id = ANY($1::varchar[])
"""
_JSON_COLUMNS = frozenset({"sampling", "request", "response"})
_COMPLETION_TYPES = {
    "id": "varchar",
    "session_id": "varchar",
    "segment_id": "varchar",
    "turn": "int",
    "prefix_len": "int",
    "prompt_delta": "bytea",
    "output_ids": "bytea",
    "logprobs": "bytea",
    "versions": "bytea",
    "min_version": "int",
    "max_version": "int",
    "finish_reason": "varchar",
    "status": "varchar",
    "side": "varchar",
    "sampling": "json",
    "request": "json",
    "response": "json",
    "latency_ms": "float8",
    "ttft_ms": "float8",
    "created_at": "timestamptz",
}
_C = 10  # the completions' parameters start at $11
_COMPLETION_ARRAYS = ", ".join(
    f"${_C + 1 + i}::{_COMPLETION_TYPES[c]}[]" for i, c in enumerate(COMPLETION_COLUMNS)
)
_WRITE = f"""
WITH turns AS (
    UPDATE sessions AS s SET turn_count = u.turns, prefix_breaks = u.breaks
    FROM unnest($1::varchar[], $2::int[], $3::int[]) AS u(id, turns, breaks)
    WHERE s.id = u.id
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
    WHERE id = ANY($10::varchar[])
    RETURNING 1
), added AS (
    INSERT INTO completions ({", ".join(COMPLETION_COLUMNS)})
    SELECT * FROM unnest({_COMPLETION_ARRAYS})
    RETURNING 1
)
SELECT (SELECT count(*) FROM extended)
"""


async def write_records(conn: asyncpg.Connection, records: list[CompletionRecord]) -> None:
    """The writes of `record_completions` (checked records) in the caller's transaction on
    `conn`; raises as `plan_writes` says, and ConflictError for a completion or segment id that
    another transaction took meanwhile."""
    now = utcnow()
    plan = plan_writes(records, await _reads(conn, records), now)
    try:
        moved = await conn.fetchval(_WRITE, *_write_args(plan, now))
    except asyncpg.UniqueViolationError as exc:
        raise ConflictError(
            f"a completion or segment id of this batch was recorded meanwhile ({exc.detail}); "
            "ids must be unique: reload the session's segments"
        ) from exc
    assert moved == len(plan.extended), "a segment changed under its session's lock"


async def _reads(conn: asyncpg.Connection, records: list[CompletionRecord]) -> TurnReads:
    sessions = session_ids(records)
    found = {
        row["id"]: ClaimedSession(
            row["id"], row["turn_count"], row["prefix_breaks"], row["ended_at"]
        )
        for row in await conn.fetch(_LOCK_SESSIONS, sessions)
    }
    taken: list[str] = []
    segments: list[StoredSegment] = []
    ids = [r.id for r in records]
    for row in await conn.fetch(_TAKEN_AND_STORED, ids, sessions, opened_segment_ids(records)):
        if row["taken"]:
            taken.append(row["id"])
        else:
            segments.append(
                StoredSegment(row["id"], row["session_id"], row["position"], row["length"])
            )
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
        plan.replaced,
        *columns,
        [seg.id for seg in plan.extended],
        [seg.stored_length for seg in plan.extended],
        [seg.length for seg in plan.extended],
        [json.dumps(seg.transcript) for seg in plan.extended],
    ]
