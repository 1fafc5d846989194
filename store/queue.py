"""The trainer's queue over ended, rewarded sessions: list, claim with a lease, consume, release.

A session is trainable when it has ended, holds at least one reward, and is pending or claimed
under an expired lease. Claims are atomic: PostgreSQL locks the chosen rows with
`FOR UPDATE SKIP LOCKED`, so concurrent trainers take disjoint sets without waiting; SQLite runs
the claim in one `BEGIN IMMEDIATE` transaction. Consumption is all-or-nothing.

Groups (`claim_groups`) are judged whole, from every trainable member the store holds, never
inside a window of the oldest sessions: a group is ready when its trainable members plus its
failed ones (ended by their agent as failed, settled at once: `store.sessions.end_session`)
reach `group_size`, or at once under `partial_groups: use`, or at its deadline
(`deadline_seconds` after its first trainable member ended), where `wait` trains it as it is and
`drop` settles it as `incomplete`. A failed member is never trained: its group trains without
it, and a group whose members all failed has nothing to claim. A session never ended that sees
nothing for `idle_seconds` is ended (`end_idle`): a crashed agent's group reaches its deadline
instead of waiting forever.

Every session the trainer settles gets its `Outcome` (`sessions.outcome`), and so does one its
agent ended as failed.

Trajectories come without their aborted turns (`store.trajectories`): a reply the agent never saw
whole is never trained.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import ColumnElement, and_, func, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from store.db import Database, utcnow
from store.errors import LeaseLostError, NotFoundError
from store.sessions import counts_in, rewarded, settled
from store.tables import CompletionRow, RewardRow, SessionRow
from store.trajectories import check_gamma, load_sessions
from store.types import Outcome, TrainState, Trajectory


def _trainable(run_id: str, now: datetime) -> ColumnElement[bool]:
    return and_(
        SessionRow.run_id == run_id,
        SessionRow.ended_at.is_not(None),
        rewarded(),
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
        loaded = await load_sessions(s, ids, include_aborted=False, include_side=False)
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


async def mark_consumed(
    db: Database, session_ids: list[str], *, owner: str, step: int, outcome: Outcome | None = None
) -> None:
    """Settle sessions this owner leases: trained at `step` (>= 1), or with another `outcome`
    at step -1. All or nothing (LeaseLostError)."""
    outcome = _outcome_of(step, outcome)
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
                train_state=TrainState.CONSUMED.value,
                consumed_step=step,
                outcome=outcome.value,
                lease_expires_at=None,
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


async def settle_consumed(
    db: Database, session_ids: list[str], *, step: int, outcome: Outcome | None = None
) -> int:
    """Mark these sessions consumed at `step` with `outcome` (trained for a step >= 1) whatever
    their lease, unless already consumed. A trainer that resumes from checkpoint `step` calls it
    with the sessions that checkpoint recorded, so a crash between saving a checkpoint and
    `mark_consumed` cannot train them twice; the trainer settles what it drops while forming a
    batch with it too. Returns how many changed."""
    outcome = _outcome_of(step, outcome)
    ids = sorted(set(session_ids))
    if not ids:
        return 0
    async with db.write() as s:
        result = await s.execute(
            update(SessionRow)
            .where(SessionRow.id.in_(ids), SessionRow.train_state != TrainState.CONSUMED.value)
            .values(**settled(step, outcome))
        )
        return int(result.rowcount or 0)  # type: ignore[attr-defined]


def _outcome_of(step: int, outcome: Outcome | None) -> Outcome:
    """A step >= 1 trains (outcome trained); any other outcome is settled at step -1."""
    if outcome is None:
        outcome = Outcome.TRAINED if step >= 1 else Outcome.STALE
    if (outcome == Outcome.TRAINED) != (step >= 1):
        raise ValueError(
            f"outcome {outcome.value} at step {step}: trained sessions are settled at their "
            "step (>= 1), every other outcome at step -1"
        )
    return outcome


async def run_counts(db: Database, run_id: str) -> tuple[int, int]:
    """(running, accepted) trajectories of a run, as staleness admission counts them: active
    sessions, and ended sessions holding a reward that were not dropped by the trainer (stale or
    filtered ones are settled at step -1)."""
    async with db.read() as s:
        return await s.run_sync(counts_in, run_id)


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
                outcome=None,
                lease_owner=None,
                lease_expires_at=None,
            )
        )
        return int(result.rowcount or 0)  # type: ignore[attr-defined]


async def release_owner(db: Database, run_id: str, owner: str) -> int:
    """Every session of the run that `owner` holds goes back to the queue at once, whatever its
    lease: a restarted trainer takes back the batch it was training when it died (it has the
    same identity) instead of waiting for the lease to expire. Returns how many."""
    async with db.write() as s:
        result = await s.execute(
            update(SessionRow)
            .where(
                SessionRow.run_id == run_id,
                SessionRow.train_state == TrainState.CLAIMED.value,
                SessionRow.lease_owner == owner,
            )
            .values(train_state=TrainState.PENDING.value, lease_owner=None, lease_expires_at=None)
        )
        return int(result.rowcount or 0)  # type: ignore[attr-defined]


@dataclass(frozen=True, slots=True)
class GroupClaim:
    """What `claim_groups` did: the trajectories it leased (whole groups), and the sessions it
    settled as `incomplete` (groups past their deadline under `drop`)."""

    trajectories: list[Trajectory]
    incomplete: list[str]
    waiting_groups: int
    """Groups still short of `group_size` and before their deadline."""


def group_key(group_id: str | None, session_id: str) -> str:
    """The key sessions are grouped by: the explicit group id, or the session alone."""
    return group_id if group_id is not None else f"solo:{session_id}"


async def claim_groups(
    db: Database,
    run_id: str,
    *,
    batch_size: int,
    group_size: int,
    partial_groups: str,
    deadline_seconds: float,
    owner: str,
    lease_seconds: float,
    gamma: float = 1.0,
) -> GroupClaim:
    """Lease whole ready groups, oldest first (by their first member's end), once they add up
    to at least `batch_size` trajectories; nothing while they do not (module docstring for
    when a group is ready: failed members count toward `group_size`, read in the same
    transaction, and are never leased). Under `drop`, groups past their deadline short of
    `group_size` are settled as `incomplete` here, in the same transaction."""
    check_gamma(gamma)
    if batch_size < 1 or group_size < 1:
        raise ValueError(f"batch_size and group_size must be >= 1, got {batch_size}, {group_size}")
    if partial_groups not in ("wait", "drop", "use"):
        raise ValueError(f"partial_groups must be wait, drop or use, got {partial_groups!r}")
    if lease_seconds <= 0:
        raise ValueError(f"lease_seconds must be > 0, got {lease_seconds}")
    async with db.write() as s:
        now = utcnow()
        rows = (
            await s.execute(
                select(SessionRow.id, SessionRow.group_id, SessionRow.ended_at)
                .where(_trainable(run_id, now))
                .order_by(SessionRow.ended_at, SessionRow.id)
            )
        ).all()
        # the failed members of the groups at hand only (by the run's group index): the run's
        # history of failures is not read at every poll (BENCHMARKS.md, "Store")
        group_ids = sorted({gid for _, gid, _ in rows if gid is not None})
        failed: dict[str, int] = {}
        if group_ids:
            failed_rows = await s.execute(
                select(SessionRow.group_id, func.count())
                .where(
                    SessionRow.run_id == run_id,
                    SessionRow.group_id.in_(group_ids),
                    SessionRow.outcome == Outcome.FAILED.value,
                )
                .group_by(SessionRow.group_id)
            )
            failed = {gid: int(n) for gid, n in failed_rows.all() if gid is not None}
        groups: dict[str, list[str]] = defaultdict(list)
        first_end: dict[str, datetime] = {}
        for sid, gid, ended in rows:
            key = group_key(gid, sid)
            groups[key].append(sid)
            assert ended is not None, "a trainable session has ended"
            first_end.setdefault(key, ended)
        deadline = timedelta(seconds=deadline_seconds)
        ready: list[str] = []
        incomplete: list[str] = []
        waiting = 0
        for key, members in groups.items():  # oldest first: rows are ordered by their end
            if len(members) + failed.get(key, 0) >= group_size or partial_groups == "use":
                ready.append(key)
            elif now - first_end[key] < deadline:
                waiting += 1
            elif partial_groups == "wait":
                ready.append(key)
            else:
                incomplete += members
        if incomplete:
            await s.execute(
                update(SessionRow)
                .where(SessionRow.id.in_(incomplete))
                .values(**settled(-1, Outcome.INCOMPLETE))
            )
        chosen: list[str] = []
        if sum(len(groups[k]) for k in ready) >= batch_size:
            for key in ready:
                if len(chosen) >= batch_size:
                    break
                chosen += groups[key]
        if chosen:
            # Still trainable once locked: an agent may have failed one since it was read.
            lock = select(SessionRow.id).where(SessionRow.id.in_(chosen), _trainable(run_id, now))
            if db.dialect == "postgresql":
                lock = lock.with_for_update(skip_locked=True, of=SessionRow)
            locked = set(await s.scalars(lock))
            chosen = [i for i in chosen if i in locked]
            await s.execute(
                update(SessionRow)
                .where(SessionRow.id.in_(chosen))
                .values(
                    train_state=TrainState.CLAIMED.value,
                    lease_owner=owner,
                    lease_expires_at=now + timedelta(seconds=lease_seconds),
                )
            )
    return GroupClaim(await _trajectories(db, chosen, gamma), incomplete, waiting)


async def end_idle(
    db: Database, run_id: str, *, idle_seconds: float
) -> tuple[list[str], list[str]]:
    """End the run's sessions that were never ended and saw no turn nor reward (nor were made)
    within `idle_seconds`: an agent that crashed. Those holding a reward become trainable like
    any ended session; those without one are settled as `orphaned`. Returns (ended, orphaned)
    ids; orphaned ones are among the ended."""
    if idle_seconds <= 0:
        raise ValueError(f"idle_seconds must be > 0, got {idle_seconds}")
    async with db.write() as s:
        now = utcnow()
        cutoff = now - timedelta(seconds=idle_seconds)
        candidates = list(
            await s.scalars(
                select(SessionRow.id).where(
                    SessionRow.run_id == run_id,
                    SessionRow.ended_at.is_(None),
                    SessionRow.created_at <= cutoff,
                )
            )
        )
        if not candidates:
            return [], []
        last_turn = await _latest(s, CompletionRow, candidates)
        last_reward = await _latest(s, RewardRow, candidates)
        idle = [
            sid
            for sid in candidates
            if all(
                _aware(t) <= cutoff
                for t in (last_turn.get(sid), last_reward.get(sid))
                if t is not None
            )
        ]
        if not idle:
            return [], []
        await s.execute(update(SessionRow).where(SessionRow.id.in_(idle)).values(ended_at=now))
        orphaned = [sid for sid in idle if sid not in last_reward]
        if orphaned:
            await s.execute(
                update(SessionRow)
                .where(SessionRow.id.in_(orphaned))
                .values(**settled(-1, Outcome.ORPHANED))
            )
    return idle, orphaned


async def _latest(
    s: AsyncSession, table: type[CompletionRow] | type[RewardRow], ids: list[str]
) -> dict[str, datetime]:
    """Session id -> the newest `created_at` of its rows in `table` (its last turn or reward)."""
    rows = await s.execute(
        select(table.session_id, func.max(table.created_at))
        .where(table.session_id.in_(ids))
        .group_by(table.session_id)
    )
    return {sid: t for sid, t in rows.all()}


def _aware(t: datetime) -> datetime:
    """A timestamp read by an aggregate (which skips the column type) as an aware UTC one."""
    return t.replace(tzinfo=UTC) if t.tzinfo is None else t


async def outcome_counts(db: Database, run_id: str) -> dict[str, int]:
    """How many of the run's sessions ended in each outcome (`Outcome`, every one present),
    plus `pending` (not settled yet)."""
    async with db.read() as s:
        rows = (
            await s.execute(
                select(SessionRow.outcome, func.count())
                .where(SessionRow.run_id == run_id)
                .group_by(SessionRow.outcome)
            )
        ).all()
    counts = {o.value: 0 for o in Outcome} | {"pending": 0}
    for outcome, n in rows:
        counts[outcome if outcome is not None else "pending"] += int(n)
    return counts
