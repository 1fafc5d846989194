"""The trainer's queue over ended, rewarded sessions: list, claim with a lease, consume, release.

A session is trainable when it has ended, holds at least one reward, and is pending or claimed
under an expired lease. Claims are atomic: PostgreSQL locks the chosen rows with
`FOR UPDATE SKIP LOCKED`, so concurrent trainers take disjoint sets without waiting; SQLite runs
the claim in one `BEGIN IMMEDIATE` transaction. Consumption is all-or-nothing.

Trajectories come without their aborted turns (`store.trajectories`): a reply the agent never saw
whole is never trained.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, and_, exists, func, or_, select, update

from store.db import Database, utcnow
from store.errors import LeaseLostError, NotFoundError
from store.tables import RewardRow, SessionRow
from store.trajectories import check_gamma, load_sessions
from store.types import TrainState, Trajectory


def _trainable(run_id: str, now: datetime) -> ColumnElement[bool]:
    return and_(
        SessionRow.run_id == run_id,
        SessionRow.ended_at.is_not(None),
        exists().where(RewardRow.session_id == SessionRow.id),
        or_(
            SessionRow.train_state == TrainState.PENDING.value,
            and_(
                SessionRow.train_state == TrainState.CLAIMED.value,
                SessionRow.lease_expires_at <= now,
            ),
        ),
    )


async def _trajectories(db: Database, ids: Sequence[str], gamma: float) -> list[Trajectory]:
    async with db.read() as s:
        loaded = await load_sessions(s, ids, include_aborted=False)
    return [loaded[i].trajectory(gamma) for i in ids if i in loaded]


async def list_trainable(
    db: Database, run_id: str, *, limit: int = 100, gamma: float = 1.0
) -> list[Trajectory]:
    check_gamma(gamma)
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    async with db.read() as s:
        ids = list(
            await s.scalars(
                select(SessionRow.id)
                .where(_trainable(run_id, utcnow()))
                .order_by(SessionRow.ended_at, SessionRow.id)
                .limit(limit)
            )
        )
    return await _trajectories(db, ids, gamma)


async def claim(
    db: Database,
    run_id: str,
    *,
    limit: int,
    owner: str,
    lease_seconds: float,
    gamma: float = 1.0,
) -> list[Trajectory]:
    check_gamma(gamma)
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    if lease_seconds <= 0:
        raise ValueError(f"lease_seconds must be > 0, got {lease_seconds}")
    async with db.write() as s:
        now = utcnow()
        stmt = (
            select(SessionRow.id)
            .where(_trainable(run_id, now))
            .order_by(SessionRow.ended_at, SessionRow.id)
            .limit(limit)
        )
        if db.dialect == "postgresql":
            stmt = stmt.with_for_update(skip_locked=True, of=SessionRow)
        ids = list(await s.scalars(stmt))
        if ids:
            await s.execute(
                update(SessionRow)
                .where(SessionRow.id.in_(ids))
                .values(
                    train_state=TrainState.CLAIMED.value,
                    lease_owner=owner,
                    lease_expires_at=now + timedelta(seconds=lease_seconds),
                )
            )
    return await _trajectories(db, ids, gamma)


async def mark_consumed(db: Database, session_ids: list[str], *, owner: str, step: int) -> None:
    ids = sorted(set(session_ids))
    if not ids:
        return
    async with db.write() as s:
        now = utcnow()
        rows = list(
            await s.scalars(
                select(SessionRow)
                .where(SessionRow.id.in_(ids))
                .order_by(SessionRow.id)
                .with_for_update()
            )
        )
        missing = sorted(set(ids) - {r.id for r in rows})
        if missing:
            raise NotFoundError(f"no sessions {missing}: nothing was marked consumed")
        lost = [
            r.id
            for r in rows
            if r.train_state != TrainState.CLAIMED.value
            or r.lease_owner != owner
            or r.lease_expires_at is None
            or r.lease_expires_at <= now
        ]
        if lost:
            raise LeaseLostError(
                f"{len(lost)} of {len(ids)} sessions are no longer leased by {owner!r} "
                f"({', '.join(lost[:5])}{', ...' if len(lost) > 5 else ''}): nothing was marked "
                "consumed; drop them from this step or claim with a longer lease_seconds"
            )
        await s.execute(
            update(SessionRow)
            .where(SessionRow.id.in_(ids))
            .values(
                train_state=TrainState.CONSUMED.value, consumed_step=step, lease_expires_at=None
            )
        )


async def release(db: Database, session_ids: list[str], *, owner: str) -> None:
    ids = sorted(set(session_ids))
    if not ids:
        return
    async with db.write() as s:
        await s.execute(
            update(SessionRow)
            .where(
                SessionRow.id.in_(ids),
                SessionRow.train_state == TrainState.CLAIMED.value,
                SessionRow.lease_owner == owner,
            )
            .values(train_state=TrainState.PENDING.value, lease_owner=None, lease_expires_at=None)
        )


async def settle_consumed(db: Database, session_ids: list[str], *, step: int) -> int:
    """Recovery after a crash: mark these sessions consumed at `step` whatever their lease, unless
    already consumed. A trainer that resumes from checkpoint `step` calls it with the sessions that
    checkpoint recorded, so a crash between saving a checkpoint and `mark_consumed` cannot train
    them twice. Returns how many changed."""
    ids = sorted(set(session_ids))
    if not ids:
        return 0
    async with db.write() as s:
        result = await s.execute(
            update(SessionRow)
            .where(SessionRow.id.in_(ids), SessionRow.train_state != TrainState.CONSUMED.value)
            .values(
                train_state=TrainState.CONSUMED.value,
                consumed_step=step,
                lease_owner=None,
                lease_expires_at=None,
            )
        )
        return int(result.rowcount or 0)  # type: ignore[attr-defined]


async def run_counts(db: Database, run_id: str) -> tuple[int, int]:
    """(running, accepted) trajectories of a run, as staleness admission counts them: active
    sessions, and ended sessions holding a reward that were not dropped by the trainer (stale or
    filtered ones are settled at step -1)."""
    rewarded = exists().where(RewardRow.session_id == SessionRow.id)
    async with db.read() as s:
        running = await s.scalar(
            select(func.count()).where(SessionRow.run_id == run_id, SessionRow.ended_at.is_(None))
        )
        accepted = await s.scalar(
            select(func.count()).where(
                SessionRow.run_id == run_id,
                SessionRow.ended_at.is_not(None),
                rewarded,
                or_(SessionRow.consumed_step.is_(None), SessionRow.consumed_step >= 0),
            )
        )
    return int(running or 0), int(accepted or 0)


async def renew(db: Database, session_ids: list[str], *, owner: str, lease_seconds: float) -> int:
    """Extend the lease of the sessions `owner` still holds by `lease_seconds` from now (a
    trainer whose step outlasts its lease renews it while the step runs). Returns how many it
    still held; sessions it lost are left as they are."""
    ids = sorted(set(session_ids))
    if not ids:
        return 0
    if lease_seconds <= 0:
        raise ValueError(f"lease_seconds must be > 0, got {lease_seconds}")
    async with db.write() as s:
        now = utcnow()
        result = await s.execute(
            update(SessionRow)
            .where(
                SessionRow.id.in_(ids),
                SessionRow.train_state == TrainState.CLAIMED.value,
                SessionRow.lease_owner == owner,
                SessionRow.lease_expires_at > now,
            )
            .values(lease_expires_at=now + timedelta(seconds=lease_seconds))
        )
        return int(result.rowcount or 0)  # type: ignore[attr-defined]


async def requeue_after(db: Database, run_id: str, *, step: int) -> int:
    """Recovery after a crash: the run's sessions consumed by a step after `step` (the newest
    checkpoint's) go back to the queue, because the weights that trained them were lost with the
    trainer. Sessions dropped on purpose (step -1) stay settled. Returns how many went back."""
    async with db.write() as s:
        result = await s.execute(
            update(SessionRow)
            .where(
                SessionRow.run_id == run_id,
                SessionRow.train_state == TrainState.CONSUMED.value,
                SessionRow.consumed_step > step,
            )
            .values(
                train_state=TrainState.PENDING.value,
                consumed_step=None,
                lease_owner=None,
                lease_expires_at=None,
            )
        )
        return int(result.rowcount or 0)  # type: ignore[attr-defined]
