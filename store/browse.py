"""Listing a run's sessions under a `SessionFilter`, page by page (the session browser and the
export), in SQL: the reward bounds on a per-session sum, the version bounds on each turn's stored
version range."""

from __future__ import annotations

from collections.abc import AsyncIterator

from sqlalchemy import ColumnElement, and_, func, select

from store.db import Database
from store.sessions import info_from_row
from store.tables import CompletionRow, RewardRow, SegmentRow, SessionRow
from store.trajectories import Loaded, load_sessions
from store.types import JSON, SessionFilter, SessionStatus, SessionSummary, TurnStatus

MAX_PAGE = 500


def _reward_total() -> ColumnElement[float]:
    """The session's reward total (NULL without rewards), read per session through the rewards'
    session index: a page reads the rewards of its own sessions, not the whole run's (a sum over
    every reward, joined, made each page of a long run's browser and each batch of its export
    cost the run's whole history: BENCHMARKS.md, "Store")."""
    return (
        select(func.sum(RewardRow.value))
        .where(RewardRow.session_id == SessionRow.id)
        .correlate(SessionRow)
        .scalar_subquery()
    )


def _where(run_id: str, f: SessionFilter, total: ColumnElement[float]) -> list[ColumnElement[bool]]:
    conds: list[ColumnElement[bool]] = [SessionRow.run_id == run_id]
    if f.status is SessionStatus.ACTIVE:
        conds.append(SessionRow.ended_at.is_(None))
    elif f.status is SessionStatus.ENDED:
        conds.append(SessionRow.ended_at.is_not(None))
    if f.train_state is not None:
        conds.append(SessionRow.train_state == f.train_state.value)
    if f.group_id is not None:
        conds.append(SessionRow.group_id == f.group_id)
    if f.rewarded is True:
        conds.append(total.is_not(None))
    elif f.rewarded is False:
        conds.append(total.is_(None))
    if f.min_reward is not None:
        conds.append(total >= f.min_reward)
    if f.max_reward is not None:
        conds.append(total <= f.max_reward)
    if f.min_prefix_breaks is not None:
        conds.append(SessionRow.prefix_breaks >= f.min_prefix_breaks)
    if f.max_prefix_breaks is not None:
        conds.append(SessionRow.prefix_breaks <= f.max_prefix_breaks)
    if f.min_version is not None or f.max_version is not None:
        turn = [CompletionRow.session_id == SessionRow.id, CompletionRow.max_version.is_not(None)]
        if f.min_version is not None:
            turn.append(CompletionRow.max_version >= f.min_version)
        if f.max_version is not None:
            turn.append(CompletionRow.min_version <= f.max_version)
        conds.append(select(CompletionRow.id).where(and_(*turn)).exists())
    return conds


async def list_sessions(
    db: Database, run_id: str, f: SessionFilter, *, limit: int = 50, offset: int = 0
) -> tuple[list[SessionSummary], int]:
    """One page of the run's matching sessions, newest first, and how many match in all."""
    if not 1 <= limit <= MAX_PAGE:
        raise ValueError(f"limit must lie in [1, {MAX_PAGE}], got {limit}")
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    total = _reward_total()
    conds = _where(run_id, f, total)
    # the turns its client got or may have got: a replaced attempt is no turn of the session
    turns = (
        select(func.count(CompletionRow.id))
        .where(
            CompletionRow.session_id == SessionRow.id,
            CompletionRow.status != TurnStatus.REPLACED.value,
        )
        .correlate(SessionRow)
        .scalar_subquery()
    )
    base = select(SessionRow, total.label("total"), turns.label("turns"))
    async with db.read() as s:
        count = await s.scalar(select(func.count()).select_from(SessionRow).where(*conds))
        rows = await s.execute(
            base.where(*conds)
            .order_by(SessionRow.created_at.desc(), SessionRow.id.desc())
            .limit(limit)
            .offset(offset)
        )
        page = [
            SessionSummary(
                info=info_from_row(r.SessionRow),
                turns=int(r.turns),
                reward=None if r.total is None else float(r.total),
            )
            for r in rows
        ]
    return page, int(count or 0)


async def iter_sessions(
    db: Database, run_id: str, f: SessionFilter, *, batch: int = 64
) -> AsyncIterator[tuple[Loaded, dict[str, JSON]]]:
    """Every matching session, oldest first, loaded whole (segments, rewards), with each
    segment's transcript by segment id; `batch` sessions per read. Aborted turns and side
    requests' turns are left out unless `f.include_aborted`, `f.include_side` (see
    `store.trajectories`)."""
    conds = _where(run_id, f, _reward_total())
    after: tuple[object, str] | None = None
    while True:
        stmt = select(SessionRow.id, SessionRow.created_at).where(*conds)
        if after is not None:
            created, sid = after
            stmt = stmt.where(
                (SessionRow.created_at > created)
                | ((SessionRow.created_at == created) & (SessionRow.id > sid))
            )
        async with db.read() as s:
            keys = (
                await s.execute(stmt.order_by(SessionRow.created_at, SessionRow.id).limit(batch))
            ).all()
            if not keys:
                return
            ids = [k.id for k in keys]
            loaded = await load_sessions(
                s, ids, include_aborted=f.include_aborted, include_side=f.include_side
            )
            found = await s.execute(
                select(SegmentRow.id, SegmentRow.transcript).where(SegmentRow.session_id.in_(ids))
            )
            transcripts: dict[str, JSON] = {sid: t for sid, t in found}
        for sid in ids:
            if sid in loaded:
                yield loaded[sid], transcripts
        after = (keys[-1].created_at, keys[-1].id)
