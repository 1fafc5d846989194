"""Runs and sessions: creation, lookup by id or bearer key, and ending."""

from __future__ import annotations

import hashlib
import secrets

from sqlalchemy import select, update

from store.db import Database, new_id, utcnow
from store.errors import NotFoundError
from store.tables import RunRow, SessionRow
from store.types import JSON, NewSession, Outcome, Run, SessionInfo, SessionStatus, TrainState

MAX_SESSIONS_PER_CALL = 1024


def hash_key(api_key: str) -> str:
    """The sha256 hex digest stored in place of a session's bearer key."""
    return hashlib.sha256(api_key.encode()).hexdigest()


def run_from_row(row: RunRow) -> Run:
    return Run(
        id=row.id, name=row.name, config=row.config, status=row.status, created_at=row.created_at
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
    )


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
) -> list[NewSession]:
    if not 1 <= count <= MAX_SESSIONS_PER_CALL:
        raise ValueError(
            f"count must be between 1 and {MAX_SESSIONS_PER_CALL}, got {count}: "
            "create more sessions with several calls"
        )
    now = utcnow()
    keys = ["rlg-" + secrets.token_urlsafe(32) for _ in range(count)]
    rows = [
        SessionRow(
            id=new_id("sess"),
            run_id=run_id,
            group_id=group_id,
            meta=dict(metadata or {}),
            key_hash=hash_key(key),
            created_at=now,
            ended_at=None,
            prefix_breaks=0,
            turn_count=0,
            train_state=TrainState.PENDING.value,
            lease_owner=None,
            lease_expires_at=None,
            consumed_step=None,
        )
        for key in keys
    ]
    async with db.write() as s:
        if await s.get(RunRow, run_id) is None:
            raise NotFoundError(f"no run {run_id!r}: create the run before its sessions")
        s.add_all(rows)
    return [NewSession(info=info_from_row(r), api_key=k) for r, k in zip(rows, keys, strict=True)]


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


async def end_session(db: Database, session_id: str) -> SessionInfo:
    async with db.write() as s:
        await s.execute(
            update(SessionRow)
            .where(SessionRow.id == session_id, SessionRow.ended_at.is_(None))
            .values(ended_at=utcnow())
        )
        row = await s.get(SessionRow, session_id)
        if row is None:
            raise session_not_found(session_id)
        return info_from_row(row)
