"""Anthropic Messages (`gateway.protocols.anthropic.adapter`) at `/v1/messages` and
`/v1/messages/count_tokens`; mounted at `/v1/...` and at `/sessions/{session_id}/v1/...`
(`gateway.routes.generate.mount_protocol`).

What the `anthropic` SDK sends is accepted as it is: `x-api-key` (or a bearer key),
`anthropic-version`, `anthropic-beta` and `?beta=true`. Errors on these routes are in Anthropic's
shape: the router's route class, `AnthropicRoute`, declares that envelope. Tools the model cannot
call are left out, named in `x-rlgateway-tools-left-out`.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway.auth import resolve
from gateway.deps import GatewayDep
from gateway.errors import error_docs
from gateway.protocols.anthropic.errors import AnthropicErrorBody, AnthropicRoute
from gateway.protocols.anthropic.types import (
    CountTokensRequest,
    MessagesRequest,
    TokenCountAnswer,
    tools_of,
)
from gateway.routes.generate import GENERATE_DOC, generate, left_out_headers, session_of

router = APIRouter(tags=["anthropic"], route_class=AnthropicRoute)


def _docs(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return error_docs(*statuses, model=AnthropicErrorBody)


@router.post("/v1/messages", responses=GENERATE_DOC | _docs(400, 401, 404, 409, 413, 429, 500, 503))
async def create_message(gw: GatewayDep, request: Request, body: MessagesRequest) -> Response:
    headers = left_out_headers(tools_of(body.tools).left_out)
    create = gw.messages.create
    return await generate(
        gw, request, body, session_of(request), "messages", create, headers=headers
    )


@router.post("/v1/messages/count_tokens", responses=_docs(400, 401, 404, 500))
async def count_tokens(
    gw: GatewayDep, request: Request, body: CountTokensRequest
) -> TokenCountAnswer:
    caller = await resolve(request, gw.sessions, gw.settings.admin_token, session_of(request))
    run = None if caller.session is None else await gw.run_configs.of(caller.session.run_id)
    return await gw.messages.count_tokens(body, run)
