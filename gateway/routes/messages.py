"""Anthropic Messages (`gateway.messages`), at `/v1/messages` and
`/sessions/{session_id}/v1/messages`, with `.../v1/messages/count_tokens`.

What the `anthropic` SDK sends is accepted as it is: `x-api-key` (or a bearer key),
`anthropic-version`, `anthropic-beta` and `?beta=true`. Errors on these routes are in Anthropic's
shape (`gateway.errors.anthropic_route`). Tools the model cannot call are left out, named in
`x-rlgateway-tools-left-out`.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway.auth import resolve
from gateway.deps import Gateway, GatewayDep
from gateway.errors import AnthropicErrorBody, error_docs
from gateway.messages_types import CountTokensRequest, MessagesRequest, tools_of
from gateway.routes.generate import GENERATE_DOC, generate, left_out_headers

router = APIRouter(tags=["anthropic"])

_CREATE_DOC = GENERATE_DOC | error_docs(
    400, 401, 404, 409, 413, 422, 429, 500, 503, model=AnthropicErrorBody
)


def _docs(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return error_docs(*statuses, model=AnthropicErrorBody)


async def _create(
    gw: Gateway, request: Request, body: MessagesRequest, session_id: str | None
) -> Response:
    headers = left_out_headers(tools_of(body.tools).left_out)
    return await generate(
        gw, request, body, session_id, "messages", gw.messages.create, headers=headers
    )


async def _count(
    gw: Gateway, request: Request, body: CountTokensRequest, session_id: str | None
) -> dict[str, int]:
    await resolve(request, gw.sessions, gw.settings.admin_token, session_id)
    return await gw.messages.count_tokens(body)


@router.post("/v1/messages", responses=_CREATE_DOC)
async def create_message(gw: GatewayDep, request: Request, body: MessagesRequest) -> Response:
    return await _create(gw, request, body, None)


@router.post("/sessions/{session_id}/v1/messages", responses=_CREATE_DOC)
async def session_create_message(
    gw: GatewayDep, request: Request, session_id: str, body: MessagesRequest
) -> Response:
    return await _create(gw, request, body, session_id)


@router.post("/v1/messages/count_tokens", responses=_docs(400, 401, 422, 500))
async def count_tokens(
    gw: GatewayDep, request: Request, body: CountTokensRequest
) -> dict[str, int]:
    return await _count(gw, request, body, None)


@router.post(
    "/sessions/{session_id}/v1/messages/count_tokens", responses=_docs(400, 401, 404, 422, 500)
)
async def session_count_tokens(
    gw: GatewayDep, request: Request, session_id: str, body: CountTokensRequest
) -> dict[str, int]:
    return await _count(gw, request, body, session_id)
