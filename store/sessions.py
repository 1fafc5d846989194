"""Runs and sessions: creation, lookup by id or bearer key, and ending (as failed, too).

A session its agent ends as failed is settled at once (`Outcome.FAILED`, its reason in
`sessions.failure`), with the same columns the trainer's queue writes when it settles one
(`settled`): it is never claimed, and its group is judged without it (`store.queue`)."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, cast

from sqlalchemy import (
    ColumnElement,
    Connection,
    Table,
    bindparam,
    exists,
    func,
    insert,
    select,
    update,
)
from sqlalchemy.engine import RowMapping
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from store.db import Database, new_id, utcnow
from store.errors import ConflictError, NotFoundError
from store.tables import RewardRow, RunRow, SessionRow
from store.types import JSON, NewSession, Outcome, Run, SessionInfo, SessionStatus, TrainState

MAX_SESSIONS_PER_CALL = 1024

MAX_FAILURE_CHARS = 500
"""The longest failure reason kept (`sessions.failure`); a longer one is truncated."""


def hash_key(api_key: str) -> str:
    """The sha256 hex digest stored in place of a session's bearer key."""
    return hashlib.sha256(api_key.encode()).hexdigest()


def run_from_row(row: RunRow) -> Run:
    return Run(
        id=row.id, name=row.name, config=row.config, status=row.status, created_at=row.created_at
    )


def info_from_columns(row: Mapping[str, Any] | RowMapping) -> SessionInfo:
    """The session of a `sessions` row's columns (a Core row, or the values inserted)."""
    outcome = row["outcome"]
    return SessionInfo(
        id=row["id"],
        run_id=row["run_id"],
        group_id=row["group_id"],
        metadata=row["metadata"],
        status=SessionStatus.ACTIVE if row["ended_at"] is None else SessionStatus.ENDED,
        created_at=row["created_at"],
        ended_at=row["ended_at"],
        prefix_breaks=row["prefix_breaks"],
        train_state=TrainState(row["train_state"]),
        outcome=Outcome(outcome) if outcome is not None else None,
        consumed_step=row["consumed_step"],
        failure=row["failure"],
    )


def info_from_row(row: SessionRow) -> SessionInfo:
    return SessionInfo(
        id=row.id,
        run_id=row.run_id,
        group_id=row.group_id,
        metadata=row.meta,
        status=SessionStatus.ACTIVE if row.ended_at is None else SessionStatus.ENDED,
        created_at=row.created_at,
        ended_at=row.ended_at,
        prefix_breaks=row.prefix_breaks,
        train_state=TrainState(row.train_state),
        outcome=Outcome(row.outcome) if row.outcome is not None else None,
        consumed_step=row.consumed_step,
        failure=row.failure,
    )


def settled(step: int, outcome: Outcome) -> dict[str, object]:
    """The columns of a session settled at `step` with `outcome`, lease released (what the
    trainer's queue writes, and an agent's failure)."""
    return {
        "train_state": TrainState.CONSUMED.value,
        "consumed_step": step,
        "outcome": outcome.value,
        "lease_owner": None,
        "lease_expires_at": None,
    }


def session_not_found(session_id: str) -> NotFoundError:
    return NotFoundError(
        f"no session {session_id!r}: check the id, or create sessions for a run first"
    )


async def create_run(db: Database, name: str, config: JSON) -> Run:
    row = RunRow(id=new_id("run"), name=name, config=config, status="active", created_at=utcnow())
    async with db.write() as s:
        s.add(row)
    return run_from_row(row)


async def get_run(db: Database, run_id: str) -> Run:
    async with db.read() as s:
        row = await s.get(RunRow, run_id)
    if row is None:
        raise NotFoundError(f"no run {run_id!r}: check the id, or create the run first")
    return run_from_row(row)


async def create_sessions(
    db: Database,
    run_id: str,
    count: int,
    *,
    group_id: str | None = None,
    metadata: JSON | None = None,
    admit: Callable[[int, int], None] | None = None,
) -> list[NewSession]:
    if not 1 <= count <= MAX_SESSIONS_PER_CALL:
        raise ValueError(
            f"count must be between 1 and {MAX_SESSIONS_PER_CALL}, got {count}: "
            "create more sessions with several calls"
        )
    now = utcnow()
    keys = ["rlg-" + secrets.token_urlsafe(32) for _ in range(count)]
    rows = [
        {
            "id": new_id("sess"),
            "run_id": run_id,
            "group_id": group_id,
            "metadata": dict(metadata or {}),
            "key_hash": hash_key(key),
            "created_at": now,
            "ended_at": None,
            "prefix_breaks": 0,
            "turn_count": 0,
            "train_state": TrainState.PENDING.value,
            "lease_owner": None,
            "lease_expires_at": None,
            "consumed_step": None,
            "outcome": None,
            "failure": None,
        }
        for key in keys
    ]

    def write(s: Connection) -> None:
        if admit is not None:
            # The run's row is locked (FOR UPDATE on PostgreSQL; SQLite's write transaction locks
            # the file): gateways creating sessions of one run at once are admitted one after the
            # other.
            if s.scalar(_LOCK_RUN, {"id": run_id}) is None:
                raise run_not_found()
            admit(*counts_in(s, run_id))
        s.execute(insert(_SESSIONS), rows)

    def run_not_found() -> NotFoundError:
        return NotFoundError(f"no run {run_id!r}: create the run before its sessions")

    if admit is None and db.dialect == "postgresql":
        from store import sessions_pg  # asyncpg, imported on PostgreSQL only

        async with db.pg_connection() as conn:
            await sessions_pg.insert_sessions(conn, rows, run_not_found)
        return _made(rows, keys)
    try:
        await db.write_sync(write)
    except IntegrityError as exc:  # without admission, the run's foreign key is the check
        async with db.read() as s:
            if await s.get(RunRow, run_id) is None:
                raise run_not_found() from exc
        raise
    return _made(rows, keys)


def _made(rows: list[dict[str, Any]], keys: list[str]) -> list[NewSession]:
    return [
        NewSession(info=info_from_columns(r), api_key=k) for r, k in zip(rows, keys, strict=True)
    ]


_SESSIONS = cast(Table, SessionRow.__table__)
# Core statements on the hot paths (an agent's session made and ended), not the ORM's unit of work
# (six times a turn's recording in CPU: BENCHMARKS.md, "Store")
_LOCK_RUN = select(RunRow.id).where(RunRow.id == bindparam("id")).with_for_update()
_END = (
    update(_SESSIONS)
    .where(_SESSIONS.c.id == bindparam("_id"), _SESSIONS.c.ended_at.is_(None))
    .values(ended_at=bindparam("_now"))
    .returning(*_SESSIONS.c)
)
_SESSION = select(_SESSIONS).where(_SESSIONS.c.id == bindparam("_id"))


def rewarded() -> ColumnElement[bool]:
    """The session holds a reward the trainer reads (a late one is for the export only)."""
    return exists().where(RewardRow.session_id == SessionRow.id, RewardRow.late.is_(False))


def counts_in(s: Connection | Session, run_id: str) -> tuple[int, int]:
    """(running, accepted) sessions of a run in the transaction `s` (`Store.run_counts`).

    Accepted: ended, holding a reward the trainer reads, not dropped by it (settled at step -1).
    Counted in two parts: the trained ones (`consumed_step >= 1`: only ended, rewarded sessions
    are ever claimed, and a reward is never taken back) from an index alone, however long the
    run's history; the ones not settled yet, few, with their rewards."""
    running = s.scalar(  # a session not ended is pending (claims take ended ones): indexed
        select(func.count()).where(
            SessionRow.run_id == run_id,
            SessionRow.train_state == TrainState.PENDING.value,
            SessionRow.ended_at.is_(None),
        )
    )
    trained = s.scalar(
        select(func.count()).where(SessionRow.run_id == run_id, SessionRow.consumed_step >= 1)
    )
    waiting = s.scalar(
        select(func.count()).where(
            SessionRow.run_id == run_id,
            SessionRow.train_state.in_((TrainState.PENDING.value, TrainState.CLAIMED.value)),
            SessionRow.ended_at.is_not(None),
            rewarded(),
        )
    )
    return int(running or 0), int(trained or 0) + int(waiting or 0)


async def session_turns(db: Database, session_id: str) -> int:
    """How many turns the session has recorded (`sessions.turn_count`)."""
    async with db.read() as s:
        turns = await s.scalar(select(SessionRow.turn_count).where(SessionRow.id == session_id))
    if turns is None:
        raise session_not_found(session_id)
    return int(turns)


async def get_session(db: Database, session_id: str) -> SessionInfo:
    async with db.read() as s:
        row = await s.get(SessionRow, session_id)
    if row is None:
        raise session_not_found(session_id)
    return info_from_row(row)


async def session_for_key(db: Database, api_key: str) -> SessionInfo | None:
    async with db.read() as s:
        row = await s.scalar(select(SessionRow).where(SessionRow.key_hash == hash_key(api_key)))
    return None if row is None else info_from_row(row)


async def end_session(db: Database, session_id: str, *, failure: str | None = None) -> SessionInfo:
    """See `Store.end_session`."""
    if failure is None and db.dialect == "postgresql":
        from store import sessions_pg

        async with db.pg_connection() as conn:
            columns = await sessions_pg.end_session(conn, session_id, utcnow())
        if columns is None:
            raise session_not_found(session_id)
        return info_from_columns(columns)
    if failure is None:
        return await db.write_sync(partial(_end, session_id=session_id))
    reason = _stored_failure(failure)
    async with db.write() as s:
        row = await s.get(SessionRow, session_id, with_for_update=True)
        if row is None:
            raise session_not_found(session_id)
        if row.outcome == Outcome.FAILED.value:
            if row.failure != reason:
                raise ConflictError(
                    f"session {session_id!r} already failed with {row.failure!r}: a session "
                    "fails once, with one reason; nothing was changed"
                )
            return info_from_row(row)
        if row.train_state != TrainState.PENDING.value:
            raise ConflictError(
                f"session {session_id!r} {_taken(row)}: it can no longer be ended as failed. "
                "End a failed episode with its failure in place of rewarding and ending it"
            )
        await s.execute(
            update(SessionRow)
            .where(SessionRow.id == session_id)
            .values(
                ended_at=row.ended_at or utcnow(),
                failure=reason,
                **settled(-1, Outcome.FAILED),
            )
        )
        await s.refresh(row)
        return info_from_row(row)


def _end(s: Connection, session_id: str) -> SessionInfo:
    # one statement for an active session; a second reads one that had ended, or finds none
    row = s.execute(_END, {"_id": session_id, "_now": utcnow()}).first()
    if row is None:
        row = s.execute(_SESSION, {"_id": session_id}).first()
    if row is None:
        raise session_not_found(session_id)
    return info_from_columns(row._mapping)


def _stored_failure(failure: str) -> str:
    """The reason as stored: at most `MAX_FAILURE_CHARS`, NUL (which PostgreSQL text cannot
    hold) replaced by U+FFFD. ValueError for an empty one."""
    if not failure:
        raise ValueError(
            "a failure reason must not be empty: say why the session failed, or end it "
            "without a failure"
        )
    return failure.replace("\x00", "\ufffd")[:MAX_FAILURE_CHARS]


def _taken(row: SessionRow) -> str:
    """How the trainer took this session (it is claimed or consumed)."""
    if row.train_state == TrainState.CLAIMED.value:
        return f"is claimed by the trainer ({row.lease_owner})"
    if row.outcome == Outcome.TRAINED.value:
        return f"was trained at step {row.consumed_step}"
    return f"was settled as {row.outcome or 'dropped'}"
