"""The OpenAI-compatible routes, at `/v1/...` and at `/sessions/{session_id}/v1/...`.

An agent's base_url is either `.../sessions/{id}/v1` (the session rides in the path) or `.../v1`
with the session key as its API key; both are recorded into that session. The admin token may call
`/v1/...` too, unrecorded (for evaluation).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from gateway.auth import require_active, resolve
from gateway.deps import GatewayDep
from gateway.openai_types import ChatCompletionRequest, CompletionRequest

router = APIRouter(tags=["openai"])


def _respond(result: dict[str, Any] | AsyncIterator[str]) -> Any:
    if isinstance(result, dict):
        return JSONResponse(result)
    return StreamingResponse(
        result,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _chat(
    gw: GatewayDep, request: Request, body: ChatCompletionRequest, session_id: str | None
) -> Any:
    caller = await resolve(request, gw.sessions, gw.settings.admin_token, session_id)
    require_active(caller)
    sid = caller.session.id if caller.session else None
    return _respond(await gw.chat.create(body, sid))


async def _completions(
    gw: GatewayDep, request: Request, body: CompletionRequest, session_id: str | None
) -> Any:
    caller = await resolve(request, gw.sessions, gw.settings.admin_token, session_id)
    require_active(caller)
    sid = caller.session.id if caller.session else None
    return _respond(await gw.completions.create(body, sid))


@router.post("/v1/chat/completions")
async def chat_completions(gw: GatewayDep, request: Request, body: ChatCompletionRequest) -> Any:
    return await _chat(gw, request, body, None)


@router.post("/sessions/{session_id}/v1/chat/completions")
async def session_chat_completions(
    gw: GatewayDep, request: Request, session_id: str, body: ChatCompletionRequest
) -> Any:
    return await _chat(gw, request, body, session_id)


@router.post("/v1/completions")
async def completions(gw: GatewayDep, request: Request, body: CompletionRequest) -> Any:
    return await _completions(gw, request, body, None)


@router.post("/sessions/{session_id}/v1/completions")
async def session_completions(
    gw: GatewayDep, request: Request, session_id: str, body: CompletionRequest
) -> Any:
    return await _completions(gw, request, body, session_id)


def _models(gw: GatewayDep) -> dict[str, Any]:
    created = int(time.time())
    model = {
        "id": gw.components.model_name,
        "object": "model",
        "created": created,
        "owned_by": "rlgateway",
    }
    return {"object": "list", "data": [model]}


@router.get("/v1/models")
async def models(gw: GatewayDep, request: Request) -> dict[str, Any]:
    await resolve(request, gw.sessions, gw.settings.admin_token, None)
    return _models(gw)


@router.get("/sessions/{session_id}/v1/models")
async def session_models(gw: GatewayDep, request: Request, session_id: str) -> dict[str, Any]:
    await resolve(request, gw.sessions, gw.settings.admin_token, session_id)
    return _models(gw)
