"""The Responses API (`gateway.protocols.responses.adapter`) at `/v1/responses`, and the kept
responses at `GET .../responses/{id}`; mounted at `/v1/...` and at `/sessions/{session_id}/v1/...`
(`gateway.routes.generate.mount_protocol`).

Tools the model cannot call (hosted tools, custom tools) are left out of the prompt, never a 400:
the answer names them in `x-rlgateway-tools-left-out`.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway.auth import resolve
from gateway.deps import GatewayDep
from gateway.errors import NotFound, error_docs
from gateway.protocols.common import OpenAIRoute
from gateway.protocols.responses.types import ResponseObject, ResponsesRequest, tools_of
from gateway.routes.generate import GENERATE_DOC, generate, left_out_headers, session_of

router = APIRouter(tags=["responses"], route_class=OpenAIRoute)


@router.post("/v1/responses", responses=GENERATE_DOC)
async def create_response(gw: GatewayDep, request: Request, body: ResponsesRequest) -> Response:
    headers = left_out_headers(tools_of(body.tools).left_out)
    return await generate(
        gw,
        request,
        body,
        session_of(request),
        "responses",
        gw.responses.create,
        headers=headers,
    )


@router.get("/v1/responses/{response_id}", responses=error_docs(401, 403, 404, 500))
async def get_response(gw: GatewayDep, request: Request, response_id: str) -> ResponseObject:
    caller = await resolve(request, gw.sessions, gw.settings.admin_token, session_of(request))
    # the admin outside a session sees every kept response; any other caller its session's
    scope = caller.session.id if caller.session is not None else None
    kept = await gw.responses.kept.get(response_id, scope)
    if kept is None:
        raise NotFound(f"no response with id {response_id!r} was kept for this key")
    return ResponseObject.model_validate(kept.response)
