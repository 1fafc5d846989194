"""Rewards: per turn (by completion id) or final, idempotent under a key.

A reward for a session the trainer has settled (or is training under a live lease) could never
be trained: it is refused (ConflictError, 409) or, by the run's `late_rewards: record`, kept
flagged `late` for the export only.

A reward is a finite number of magnitude at most `MAX_ABS_REWARD`, so that every sum and
discounted return of a session's rewards is finite too (a JSON number, never Infinity)."""

from __future__ import annotations

import math
from datetime import datetime
from typing import Literal

from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncSession

from store.db import Database, utcnow
from store.errors import ConflictError, NotFoundError
from store.sessions import session_not_found
from store.tables import CompletionRow, RewardRow, SessionRow
from store.types import Outcome, TrainState

LateRewards = Literal["refuse", "record"]
"""What a reward for a session the trainer already took gets (`RunConfig.late_rewards`)."""

MAX_ABS_REWARD = 1e6
"""The largest magnitude of one reward."""


def _check_reward(value: float) -> None:
    if not (math.isfinite(value) and abs(value) <= MAX_ABS_REWARD):
        raise ValueError(
            f"a reward must be a finite number in [-{MAX_ABS_REWARD:g}, {MAX_ABS_REWARD:g}], "
            f"got {value}"
        )


async def _lock_target(s: AsyncSession, session_id: str, completion_id: str | None) -> SessionRow:
    """Lock the session's row and check that `completion_id` (if any) is one of its
    completions. The lock orders concurrent reward writes to one session (Postgres), so a
    check-then-insert inside the transaction cannot race another."""
    row = await s.get(SessionRow, session_id, with_for_update=True)
    if row is None:
        raise session_not_found(session_id)
    if completion_id is None:
        return row
    owner = await s.scalar(
        select(CompletionRow.session_id).where(CompletionRow.id == completion_id)
    )
    if owner != session_id:
        raise NotFoundError(
            f"session {session_id!r} has no completion {completion_id!r}: use the id of a "
            "completion returned to this session, or omit it for the final reward"
        )
    return row


def _settled(row: SessionRow, now: datetime) -> str | None:
    """Why a reward for this session could never be trained (None when it still can): the
    trainer has settled it, or is training it under a live lease."""
    if row.train_state == TrainState.CONSUMED.value:
        if row.outcome == Outcome.TRAINED.value:
            return f"was trained at step {row.consumed_step}"
        return f"was settled as {row.outcome or 'dropped'}"
    if row.train_state == TrainState.CLAIMED.value and (
        row.lease_expires_at is not None and row.lease_expires_at > now
    ):
        return "is being trained"
    return None


async def add_reward(
    db: Database,
    session_id: str,
    value: float,
    *,
    completion_id: str | None = None,
    key: str | None = None,
    late: LateRewards = "refuse",
) -> bool:
    """See `Store.add_reward`."""
    _check_reward(value)
    async with db.write() as s:
        row = await _lock_target(s, session_id, completion_id)
        why = _settled(row, utcnow())
        if why is not None and late == "refuse":
            raise ConflictError(
                f"session {session_id!r} {why}: a reward now would never be trained. Post "
                "rewards before the trainer takes the session (before or right after ending "
                "it), or set the run's late_rewards to record to keep late ones for export"
            )
        if key is not None:
            held = await s.scalar(
                select(RewardRow).where(RewardRow.session_id == session_id, RewardRow.key == key)
            )
            if held is not None:
                if held.value == value and held.completion_id == completion_id:
                    return False
                target = "final" if held.completion_id is None else repr(held.completion_id)
                raise ConflictError(
                    f"reward key {key!r} of session {session_id!r} already holds {held.value} "
                    f"({target}); a key is written once: use a new key for another reward"
                )
        s.add(
            RewardRow(
                session_id=session_id,
                completion_id=completion_id,
                key=key,
                value=float(value),
                created_at=utcnow(),
                late=why is not None,
            )
        )
    return True


async def set_reward(
    db: Database, session_id: str, value: float, *, completion_id: str | None = None
) -> None:
    """Set a turn's (or, with no `completion_id`, the episode's final) reward by hand: every
    reward held for that target is replaced by this one value, under the key `manual:<target>`,
    in one transaction. Other targets' rewards are untouched."""
    _check_reward(value)
    async with db.write() as s:
        await _lock_target(s, session_id, completion_id)
        target = (
            RewardRow.completion_id.is_(None)
            if completion_id is None
            else RewardRow.completion_id == completion_id
        )
        await s.execute(delete(RewardRow).where(RewardRow.session_id == session_id, target))
        s.add(
            RewardRow(
                session_id=session_id,
                completion_id=completion_id,
                key=f"manual:{completion_id or 'final'}",
                value=float(value),
                created_at=utcnow(),
            )
        )
