"""Rewards: per turn (by completion id) or final, idempotent under a key.

A reward is a finite number of magnitude at most `MAX_ABS_REWARD`, so that every sum and
discounted return of a session's rewards is finite too (a JSON number, never Infinity)."""

from __future__ import annotations

import math

from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncSession

from store.db import Database, utcnow
from store.errors import ConflictError, NotFoundError
from store.sessions import session_not_found
from store.tables import CompletionRow, RewardRow, SessionRow

MAX_ABS_REWARD = 1e6
"""The largest magnitude of one reward."""


def _check_reward(value: float) -> None:
    if not (math.isfinite(value) and abs(value) <= MAX_ABS_REWARD):
        raise ValueError(
            f"a reward must be a finite number in [-{MAX_ABS_REWARD:g}, {MAX_ABS_REWARD:g}], "
            f"got {value}"
        )


async def _lock_target(s: AsyncSession, session_id: str, completion_id: str | None) -> None:
    """Lock the session's row and check that `completion_id` (if any) is one of its
    completions. The lock orders concurrent reward writes to one session (Postgres), so a
    check-then-insert inside the transaction cannot race another."""
    if await s.get(SessionRow, session_id, with_for_update=True) is None:
        raise session_not_found(session_id)
    if completion_id is None:
        return
    owner = await s.scalar(
        select(CompletionRow.session_id).where(CompletionRow.id == completion_id)
    )
    if owner != session_id:
        raise NotFoundError(
            f"session {session_id!r} has no completion {completion_id!r}: use the id of a "
            "completion returned to this session, or omit it for the final reward"
        )


async def add_reward(
    db: Database,
    session_id: str,
    value: float,
    *,
    completion_id: str | None = None,
    key: str | None = None,
) -> bool:
    """See `Store.add_reward`."""
    _check_reward(value)
    async with db.write() as s:
        await _lock_target(s, session_id, completion_id)
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
