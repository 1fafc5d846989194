"""Run management: listing with counts, status and config changes, agent keys, deletion with all
data.

A run's agent key (`rlr-...`) is returned once and stored as its sha256, like session keys.
Deleting a run is one statement inside one transaction: its sessions, segments, completions,
rewards and training steps go with it through `ON DELETE CASCADE`.
"""

from __future__ import annotations

import hmac
import secrets

from sqlalchemy import case, delete, func, select, update

from store.db import Database
from store.errors import NotFoundError
from store.sessions import hash_key, run_from_row
from store.tables import RewardRow, RunRow, SessionRow, TrainStepRow
from store.types import JSON, Run, RunStatus, RunSummary, TrainState

RUN_KEY_PREFIX = "rlr-"


def run_not_found(run_id: str) -> NotFoundError:
    return NotFoundError(f"no run {run_id!r}: check the id, or create the run first")


async def list_runs(db: Database) -> list[RunSummary]:
    """Every run, newest first, with its session counts and newest step."""
    rewarded = select(RewardRow.session_id).where(RewardRow.session_id == SessionRow.id).exists()
    counts = (
        select(
            SessionRow.run_id,
            func.count().label("sessions"),
            func.sum(case((SessionRow.ended_at.is_(None), 1), else_=0)).label("active"),
            func.sum(case((rewarded, 1), else_=0)).label("rewarded"),
            func.sum(case((SessionRow.train_state == TrainState.CONSUMED.value, 1), else_=0)).label(
                "consumed"
            ),
        )
        .group_by(SessionRow.run_id)
        .subquery()
    )
    steps = (
        select(TrainStepRow.run_id, func.max(TrainStepRow.step).label("last_step"))
        .group_by(TrainStepRow.run_id)
        .subquery()
    )
    async with db.read() as s:
        rows = await s.execute(
            select(RunRow, counts, steps.c.last_step)
            .outerjoin(counts, counts.c.run_id == RunRow.id)
            .outerjoin(steps, steps.c.run_id == RunRow.id)
            .order_by(RunRow.created_at.desc(), RunRow.id)
        )
        return [
            RunSummary(
                run=run_from_row(r.RunRow),
                sessions=int(r.sessions or 0),
                active=int(r.active or 0),
                rewarded=int(r.rewarded or 0),
                consumed=int(r.consumed or 0),
                last_step=r.last_step,
            )
            for r in rows
        ]


async def unstopped_runs(db: Database) -> list[Run]:
    """Runs that are active or paused (what `/metrics` reports on), newest first."""
    async with db.read() as s:
        rows = await s.scalars(
            select(RunRow)
            .where(RunRow.status != RunStatus.STOPPED.value)
            .order_by(RunRow.created_at.desc(), RunRow.id)
        )
        return [run_from_row(r) for r in rows]


async def set_status(db: Database, run_id: str, status: RunStatus) -> Run:
    """Set the run's status (any transition: the API refuses to restart a stopped run)."""
    async with db.write() as s:
        await s.execute(update(RunRow).where(RunRow.id == run_id).values(status=status.value))
        row = await s.get(RunRow, run_id)
        if row is None:
            raise run_not_found(run_id)
        return run_from_row(row)


async def set_config(db: Database, run_id: str, config: JSON) -> Run:
    """Replace the run's stored config (the caller validated it, as `POST /runs` does)."""
    async with db.write() as s:
        await s.execute(update(RunRow).where(RunRow.id == run_id).values(config=config))
        row = await s.get(RunRow, run_id)
        if row is None:
            raise run_not_found(run_id)
        return run_from_row(row)


async def new_key(db: Database, run_id: str) -> str:
    """A new agent key for the run, replacing any earlier one (which stops working)."""
    key = RUN_KEY_PREFIX + secrets.token_urlsafe(32)
    async with db.write() as s:
        done = await s.execute(
            update(RunRow).where(RunRow.id == run_id).values(key_hash=hash_key(key))
        )
        if not done.rowcount:  # type: ignore[attr-defined]
            raise run_not_found(run_id)
    return key


async def run_for_key(db: Database, api_key: str) -> Run | None:
    """The run whose agent key this is, or None."""
    digest = hash_key(api_key)
    async with db.read() as s:
        row = await s.scalar(select(RunRow).where(RunRow.key_hash == digest))
    # The lookup is by digest; compare the digest again in constant time all the same.
    if row is None or row.key_hash is None or not hmac.compare_digest(row.key_hash, digest):
        return None
    return run_from_row(row)


async def delete_run(db: Database, run_id: str) -> list[str]:
    """Delete the run with all its data, atomically; returns its former session ids."""
    async with db.write() as s:
        if await s.get(RunRow, run_id, with_for_update=True) is None:
            raise run_not_found(run_id)
        ids = list(await s.scalars(select(SessionRow.id).where(SessionRow.run_id == run_id)))
        await s.execute(delete(RunRow).where(RunRow.id == run_id))
    return ids
