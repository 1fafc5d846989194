"""Rewards: per turn (by completion id) or final, idempotent under a key."""

from __future__ import annotations

import math

from sqlalchemy import delete, select

from store.db import Database, utcnow
from store.errors import ConflictError, NotFoundError
from store.sessions import session_not_found
from store.tables import CompletionRow, RewardRow, SessionRow


async def add_reward(
    db: Database,
    session_id: str,
    value: float,
    *,
    completion_id: str | None = None,
    key: str | None = None,
) -> bool:
    """See `Store.add_reward`."""
    if not math.isfinite(value):
        raise ValueError(f"a reward must be a finite number, got {value}")
    async with db.write() as s:
        # The session row lock orders concurrent rewards for one session (Postgres), so the
        # key check below cannot race another insert of the same key.
        if await s.get(SessionRow, session_id, with_for_update=True) is None:
            raise session_not_found(session_id)
        if completion_id is not None:
            owner = await s.scalar(
                select(CompletionRow.session_id).where(CompletionRow.id == completion_id)
            )
            if owner != session_id:
                raise NotFoundError(
                    f"session {session_id!r} has no completion {completion_id!r}: use the id "
                    "of a completion returned to this session, or omit it for a final reward"
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
            )
        )
    return True


async def set_reward(
    db: Database, session_id: str, value: float, *, completion_id: str | None = None
) -> None:
    """Set a turn's (or, with no `completion_id`, the episode's final) reward by hand: every
    reward held for that target is replaced by this one value, under the key `manual:<target>`,
    in one transaction. Other targets' rewards are untouched."""
    if not math.isfinite(value):
        raise ValueError(f"a reward must be a finite number, got {value}")
    async with db.write() as s:
        if await s.get(SessionRow, session_id, with_for_update=True) is None:
            raise session_not_found(session_id)
        if completion_id is not None:
            owner = await s.scalar(
                select(CompletionRow.session_id).where(CompletionRow.id == completion_id)
            )
            if owner != session_id:
                raise NotFoundError(
                    f"session {session_id!r} has no completion {completion_id!r}: use one of "
                    "its completion ids, or omit it to set the final reward"
                )
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
