"""`GET /runs/{id}/export`: a run's trajectories as streamed JSONL (schema in `gateway.export`)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from gateway.deps import GatewayDep
from gateway.errors import error_docs
from gateway.export import SCHEMA, jsonl
from gateway.routes.access import RunAgentDep
from gateway.routes.run_sessions import SessionFilterDep
from gateway.run_configs import discount_of
from store.run_config import run_config_of

router = APIRouter(tags=["export"])


@router.get(
    "/runs/{run_id}/export",
    response_class=StreamingResponse,
    responses={
        200: {"content": {"application/x-ndjson": {}}, "description": "JSON Lines, one a session"},
        **error_docs(400, 401, 403, 404, 422, 500),
    },
)
async def export_run(
    gw: GatewayDep,
    _: RunAgentDep,
    run_id: str,
    where: SessionFilterDep,
) -> StreamingResponse:
    """The run's sessions as JSON Lines (`rlgateway.trajectory.v1`), oldest first, streamed:
    one object per session with its segments' tokens, loss mask, behaviour logprobs, policy
    versions, chat transcript, rewards and discounted returns. The filters are those of
    `GET /runs/{id}/sessions`; `status=ended&rewarded=true` gives what a trainer would use."""
    run = await gw.store.get_run(run_id)
    gamma = discount_of(run_config_of(run.config), gw.settings.discount)
    return StreamingResponse(
        jsonl(gw.store, run_id, where, gamma),
        media_type="application/x-ndjson",
        headers={
            "Content-Disposition": f'attachment; filename="{run_id}.jsonl"',
            "X-Schema": SCHEMA,
        },
    )
