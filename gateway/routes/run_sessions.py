"""A run's sessions: create them (admin or the run's key, under staleness admission) and browse
them with filters, page by page."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query
from pydantic import Field, Strict

from gateway.admission import admitter
from gateway.deps import GatewayDep
from gateway.errors import BadRequest, Conflict, TooManyRequests, error_docs
from gateway.limits import MAX_INT32, CheckedBody
from gateway.routes.access import RunAgentDep
from gateway.views import summary_json
from store.browse import MAX_PAGE
from store.types import RunStatus, SessionFilter, SessionStatus, TrainState

router = APIRouter(tags=["sessions"], responses=error_docs(401, 403, 404, 422, 500))


class SessionsCreate(CheckedBody):
    count: Annotated[int, Strict()] = Field(1, ge=1, le=1024)
    group_id: str | None = Field(None, max_length=200)
    """GRPO group: sessions that answer the same prompt share one group_id."""
    metadata: dict[str, Any] = Field(default_factory=dict)
    """Free data kept with each session (the task, its answer, ...)."""


@router.post("/runs/{run_id}/sessions", status_code=201, responses=error_docs(400, 409, 413, 429))
async def create_sessions(
    gw: GatewayDep, _: RunAgentDep, run_id: str, body: SessionsCreate
) -> dict[str, Any]:
    """New sessions, each with its `base_url` and `api_key` for an OpenAI client. 429 with
    Retry-After while the run is at its staleness bound; 409 for a stopped run."""
    run = await gw.store.get_run(run_id)
    if run.status == RunStatus.STOPPED:
        raise Conflict(f"run {run_id} is stopped: it takes no new sessions")
    try:
        created = await gw.store.create_sessions(
            run_id,
            body.count,
            group_id=body.group_id,
            metadata=body.metadata,
            admit=admitter(run, body.count, gw.engine.version()),
        )
    except TooManyRequests:
        gw.metrics.admission_rejections.inc()
        raise
    for s in created:  # known to be empty: no need to load their segments later
        gw.sessions.remember_key(s.api_key, s.info)
        gw.recorder.tracker.register_empty(s.info.id)
    base = gw.settings.base_url()
    return {
        "sessions": [
            {
                "id": s.info.id,
                "run_id": s.info.run_id,
                "group_id": s.info.group_id,
                "base_url": f"{base}/sessions/{s.info.id}/v1",
                "api_key": s.api_key,
            }
            for s in created
        ]
    }


@router.get("/runs/{run_id}/sessions", responses=error_docs(400))
async def list_sessions(
    gw: GatewayDep,
    _: RunAgentDep,
    run_id: str,
    where: SessionFilterDep,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 50,
    offset: Annotated[int, Query(ge=0, le=MAX_INT32)] = 0,
) -> dict[str, Any]:
    """A page of the run's sessions, newest first, filtered as `session_filter` says.
    `next_offset` is null on the last page."""
    await gw.store.get_run(run_id)
    page, total = await gw.store.list_sessions(run_id, where, limit=limit, offset=offset)
    more = offset + len(page) < total
    return {
        "sessions": [summary_json(s) for s in page],
        "total": total,
        "offset": offset,
        "next_offset": offset + len(page) if more else None,
    }


def session_filter(
    status: SessionStatus | None = None,
    train_state: TrainState | None = None,
    group_id: str | None = None,
    rewarded: bool | None = None,
    min_reward: Annotated[float | None, Query(allow_inf_nan=False)] = None,
    max_reward: Annotated[float | None, Query(allow_inf_nan=False)] = None,
    min_version: Annotated[int | None, Query(ge=-1, le=MAX_INT32)] = None,
    max_version: Annotated[int | None, Query(ge=-1, le=MAX_INT32)] = None,
    min_prefix_breaks: Annotated[int | None, Query(ge=0, le=MAX_INT32)] = None,
    max_prefix_breaks: Annotated[int | None, Query(ge=0, le=MAX_INT32)] = None,
) -> SessionFilter:
    """The session filters of a query string (all optional, bounds inclusive): `status`
    (active, ended), `train_state` (pending, claimed, consumed), `group_id`, `rewarded`,
    `min_reward`/`max_reward` (on the session's total reward; finite), `min_version`/
    `max_version` (a sampled token of a policy version in range), `min_prefix_breaks`/
    `max_prefix_breaks`; integers up to 2^31-1 (the store's integer columns). 422 for a value
    out of range, 400 for a bound pair that cannot match."""
    for low, lo, high, hi in (
        ("min_reward", min_reward, "max_reward", max_reward),
        ("min_version", min_version, "max_version", max_version),
        ("min_prefix_breaks", min_prefix_breaks, "max_prefix_breaks", max_prefix_breaks),
    ):
        if lo is not None and hi is not None and lo > hi:
            raise BadRequest(f"{low} ({lo}) is above {high} ({hi}): swap them", param=low)
    return SessionFilter(
        status=status,
        train_state=train_state,
        group_id=group_id,
        rewarded=rewarded,
        min_reward=min_reward,
        max_reward=max_reward,
        min_version=min_version,
        max_version=max_version,
        min_prefix_breaks=min_prefix_breaks,
        max_prefix_breaks=max_prefix_breaks,
    )


SessionFilterDep = Annotated[SessionFilter, Depends(session_filter)]
"""The filters `GET /runs/{id}/sessions` and `GET /runs/{id}/export` share."""
