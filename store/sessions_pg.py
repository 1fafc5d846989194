"""An agent's session made and ended on PostgreSQL through asyncpg itself: one statement each,
committed on its own (no BEGIN and COMMIT round trips), for the hot path beside the turns'
(`store.turns_pg`). The same rows and the same answers as `store.sessions`' Core statements."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from typing import Any

import asyncpg

from store.types import TrainState

_COLUMNS = (
    "id, run_id, group_id, metadata, created_at, ended_at, prefix_breaks, train_state, outcome, "
    "consumed_step, failure"
)
_INSERT = """
INSERT INTO sessions (id, run_id, group_id, metadata, key_hash, created_at, prefix_breaks,
                      turn_count, train_state)
SELECT u.id, $3, $4, $5::json, u.key_hash, $6, 0, 0, $7
FROM unnest($1::varchar[], $2::varchar[]) AS u(id, key_hash)
"""
_END = f"""
UPDATE sessions SET ended_at = $2 WHERE id = $1 AND ended_at IS NULL RETURNING {_COLUMNS}
"""
_SESSION = f"SELECT {_COLUMNS} FROM sessions WHERE id = $1"


async def insert_sessions(
    conn: asyncpg.Connection,
    rows: list[dict[str, Any]],
    run_not_found: Callable[[], Exception],
) -> None:
    """Insert the rows `store.sessions.create_sessions` made (one run, group and metadata);
    raises `run_not_found()` for an unknown run."""
    first = rows[0]
    try:
        await conn.execute(
            _INSERT,
            [r["id"] for r in rows],
            [r["key_hash"] for r in rows],
            first["run_id"],
            first["group_id"],
            json.dumps(first["metadata"]),
            first["created_at"],
            TrainState.PENDING.value,
        )
    except asyncpg.ForeignKeyViolationError as exc:
        raise run_not_found() from exc


async def end_session(
    conn: asyncpg.Connection, session_id: str, now: datetime
) -> dict[str, Any] | None:
    """End an active session (one statement); the session's columns as they now are, or None
    for an unknown id."""
    row = await conn.fetchrow(_END, session_id, now)
    if row is None:
        row = await conn.fetchrow(_SESSION, session_id)
    if row is None:
        return None
    return dict(row.items())  # the pool's connections decode json (SQLAlchemy's codec)
