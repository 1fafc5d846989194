"""What the store tests share: raw SQL on the store's database, row counts, completion records,
and sessions with one recorded turn."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, create_async_engine
from sqlalchemy.pool import NullPool

from store import (
    Store,
)
from store.db import normalize_url
from store.types import CompletionRecord, TurnStatus


@asynccontextmanager
async def raw(url: str) -> AsyncIterator[AsyncConnection]:
    """A plain connection beside the store's, to look at what it really wrote."""
    engine = create_async_engine(normalize_url(url), poolclass=NullPool)
    try:
        async with engine.connect() as conn:
            yield conn
    finally:
        await engine.dispose()


async def count(url: str, table: str, session_id: str) -> int:
    async with raw(url) as conn:
        sql = text(f"SELECT COUNT(*) FROM {table} WHERE session_id = :sid")
        return int((await conn.execute(sql, {"sid": session_id})).scalar_one())


def rec(
    cid: str,
    session_id: str,
    segment: int,
    *,
    prompt: list[int],
    prefix_len: int,
    output: list[int],
    logprobs: list[float] | None = None,
    versions: list[int] | None = None,
    opens: bool = False,
    prefix_break: bool = False,
    status: TurnStatus = TurnStatus.OK,
    finish_reason: str = "stop",
) -> CompletionRecord:
    return CompletionRecord(
        id=cid,
        session_id=session_id,
        segment_id=f"{session_id}-seg{segment}",
        segment_index=segment,
        opens_segment=opens,
        prefix_break=prefix_break,
        transcript={"messages": [{"role": "user", "content": cid}]},
        prefix_len=prefix_len,
        prompt_ids=prompt,
        output_ids=output,
        logprobs=logprobs if logprobs is not None else [-0.5] * len(output),
        versions=versions if versions is not None else [0] * len(output),
        finish_reason=finish_reason,
        status=status,
        sampling={"temperature": 1.0},
        request={"model": "tiny"},
        response={"id": cid},
        latency_ms=12.5,
    )


async def new_session(store: Store, **kwargs: Any) -> str:
    run = await store.create_run("test", {})
    (new,) = await store.create_sessions(run.id, 1, **kwargs)
    return new.info.id


async def one_turn_session(store: Store, run_id: str, cid: str) -> str:
    (new,) = await store.create_sessions(run_id, 1)
    sid = new.info.id
    await store.record_completions(
        [rec(cid, sid, 0, prompt=[1], prefix_len=0, output=[2], opens=True)]
    )
    return sid


# migrations


OWNER = "trainer:test"


async def group(
    store: Store,
    run_id: str,
    gid: str | None,
    n: int,
    *,
    end: bool = True,
    reward: float | None = 1.0,
    sampling: dict[str, Any] | None = None,
) -> list[str]:
    """n sessions of one group, each with one turn; ended and rewarded as asked."""
    made = await store.create_sessions(run_id, n, group_id=gid)
    ids = []
    for k, new in enumerate(made):
        sid = new.info.id
        await store.record_completions([record(sid, f"{sid}-c{k}", sampling=sampling)])
        if reward is not None:
            await store.add_reward(sid, reward + 0.1 * k)
        if end:
            await store.end_session(sid)
        ids.append(sid)
    return ids


async def claim(store: Store, run_id: str, **kw: Any) -> Any:
    args: dict[str, Any] = dict(
        batch_size=4,
        group_size=2,
        partial_groups="wait",
        deadline_seconds=60.0,
        owner=OWNER,
        lease_seconds=60.0,
    )
    return await store.claim_groups(run_id, **(args | kw))


def ids(trajs: Iterable[Any]) -> set[str]:
    return {t.session.id for t in trajs}


async def outcomes(store: Store, sids: Iterable[str]) -> dict[str, str | None]:
    out = {}
    for sid in sids:
        info = await store.get_session(sid)
        out[sid] = info.outcome.value if info.outcome is not None else None
    return out


def record(
    sid: str, cid: str, *, sampling: dict[str, Any] | None = None, segment: int = 0
) -> CompletionRecord:
    """A one-turn segment (`segment` > 0: a later one, after a prefix break)."""
    return CompletionRecord(
        id=cid,
        session_id=sid,
        segment_id=f"{sid}-seg{segment}",
        segment_index=segment,
        opens_segment=True,
        prefix_break=segment > 0,
        transcript={"messages": [{"role": "user", "content": cid}]},
        prefix_len=0,
        prompt_ids=[10, 11, 12],
        output_ids=[20, 21, 22, 23],
        logprobs=[-5.5, -5.6, -5.4, -5.5],
        versions=[0, 0, 0, 0],
        finish_reason="stop",
        sampling=sampling if sampling is not None else {"temperature": 1.0},
        request={"model": "tiny"},
        response={"id": cid},
        latency_ms=1.0,
    )
