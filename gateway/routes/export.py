"""`GET /runs/{id}/export`: a run's trajectories as streamed JSONL (schema in `gateway.export`)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import StreamingResponse

from gateway.app import GatewayDep
from gateway.export import SCHEMA, jsonl
from gateway.routes.access import RunAgentDep
from gateway.routes.run_sessions import filter_from
from store.types import SessionStatus, TrainState

router = APIRouter(tags=["export"])


@router.get(
    "/runs/{run_id}/export",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/x-ndjson": {}}}},
)
async def export_run(
    gw: GatewayDep,
    _: RunAgentDep,
    run_id: str,
    status: SessionStatus | None = None,
    train_state: TrainState | None = None,
    group_id: str | None = None,
    rewarded: bool | None = None,
    min_reward: float | None = None,
    max_reward: float | None = None,
    min_version: Annotated[int | None, Query(ge=-1)] = None,
    max_version: Annotated[int | None, Query(ge=-1)] = None,
) -> StreamingResponse:
    """The run's sessions as JSON Lines (`rlgateway.trajectory.v1`), oldest first, streamed:
    one object per session with its segments' tokens, loss mask, behaviour logprobs, policy
    versions, chat transcript, rewards and discounted returns. The filters are those of
    `GET /runs/{id}/sessions`; `status=ended&rewarded=true` gives what a trainer would use."""
    run = await gw.store.get_run(run_id)
    where = filter_from(
        status=status,
        train_state=train_state,
        group_id=group_id,
        rewarded=rewarded,
        min_reward=min_reward,
        max_reward=max_reward,
        min_version=min_version,
        max_version=max_version,
    )
    gamma = float(run.config.get("discount", gw.settings.discount))
    return StreamingResponse(
        jsonl(gw.store, run_id, where, gamma),
        media_type="application/x-ndjson",
        headers={
            "Content-Disposition": f'attachment; filename="{run_id}.jsonl"',
            "X-Schema": SCHEMA,
        },
    )
