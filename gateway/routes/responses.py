"""The Responses API (`gateway.responses`), at `/v1/responses` and
`/sessions/{session_id}/v1/responses`, and the kept responses at `GET .../responses/{id}`.

Tools the model cannot call (hosted tools, custom tools) are left out of the prompt, never a 400:
the answer names them in `x-rlgateway-tools-left-out`.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway.auth import resolve
from gateway.deps import Gateway, GatewayDep
from gateway.errors import NotFound, error_docs
from gateway.responses_types import ResponsesRequest, tools_of
from gateway.routes.generate import GENERATE_DOC, generate, left_out_headers

router = APIRouter(tags=["responses"])


async def _create(
    gw: Gateway, request: Request, body: ResponsesRequest, session_id: str | None
) -> Response:
    headers = left_out_headers(tools_of(body.tools).left_out)
    return await generate(
        gw, request, body, session_id, "responses", gw.responses.create, headers=headers
    )


async def _get(gw: Gateway, request: Request, response_id: str, session_id: str | None) -> Any:
    caller = await resolve(request, gw.sessions, gw.settings.admin_token, session_id)
    # the admin outside a session sees every kept response; any other caller its session's
    scope = caller.session.id if caller.session is not None else None
    kept = await gw.responses.kept.get(response_id, scope)
    if kept is None:
        raise NotFound(f"no response with id {response_id!r} was kept for this key")
    return kept.response


@router.post("/v1/responses", responses=GENERATE_DOC)
async def create_response(gw: GatewayDep, request: Request, body: ResponsesRequest) -> Response:
    return await _create(gw, request, body, None)


@router.post("/sessions/{session_id}/v1/responses", responses=GENERATE_DOC)
async def session_create_response(
    gw: GatewayDep, request: Request, session_id: str, body: ResponsesRequest
) -> Response:
    return await _create(gw, request, body, session_id)


@router.get("/v1/responses/{response_id}", responses=error_docs(401, 403, 404, 422, 500))
async def get_response(gw: GatewayDep, request: Request, response_id: str) -> Any:
    return await _get(gw, request, response_id, None)


@router.get(
    "/sessions/{session_id}/v1/responses/{response_id}",
    responses=error_docs(401, 404, 422, 500),
)
async def session_get_response(
    gw: GatewayDep, request: Request, session_id: str, response_id: str
) -> Any:
    return await _get(gw, request, response_id, session_id)
