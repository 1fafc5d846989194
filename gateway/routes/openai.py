"""The OpenAI-compatible routes, at `/v1/...` and at `/sessions/{session_id}/v1/...`.

An agent's base_url is either `.../sessions/{id}/v1` (the session rides in the path) or `.../v1`
with the session key as its API key; both are recorded into that session. The admin token may call
`/v1/...` too, unrecorded (for evaluation). What every generation route shares (connected
clients only, retries, the sampling contract) is `gateway.routes.generate`.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway.auth import resolve
from gateway.deps import Gateway, GatewayDep
from gateway.errors import error_docs
from gateway.openai_types import ChatCompletionRequest, CompletionRequest, check_vocab
from gateway.routes.generate import GENERATE_DOC, generate

router = APIRouter(tags=["openai"])


def _vocab(gw: Gateway, body: ChatCompletionRequest | CompletionRequest) -> Any:
    return lambda: check_vocab(body, len(gw.components.tokenizer))


async def _chat(
    gw: Gateway, request: Request, body: ChatCompletionRequest, session_id: str | None
) -> Response:
    return await generate(
        gw, request, body, session_id, "chat", gw.chat.create, check=_vocab(gw, body)
    )


async def _completions(
    gw: Gateway, request: Request, body: CompletionRequest, session_id: str | None
) -> Response:
    return await generate(
        gw, request, body, session_id, "completions", gw.completions.create, check=_vocab(gw, body)
    )


@router.post("/v1/chat/completions", responses=GENERATE_DOC)
async def chat_completions(
    gw: GatewayDep, request: Request, body: ChatCompletionRequest
) -> Response:
    return await _chat(gw, request, body, None)


@router.post("/sessions/{session_id}/v1/chat/completions", responses=GENERATE_DOC)
async def session_chat_completions(
    gw: GatewayDep, request: Request, session_id: str, body: ChatCompletionRequest
) -> Response:
    return await _chat(gw, request, body, session_id)


@router.post("/v1/completions", responses=GENERATE_DOC)
async def completions(gw: GatewayDep, request: Request, body: CompletionRequest) -> Response:
    return await _completions(gw, request, body, None)


@router.post("/sessions/{session_id}/v1/completions", responses=GENERATE_DOC)
async def session_completions(
    gw: GatewayDep, request: Request, session_id: str, body: CompletionRequest
) -> Response:
    return await _completions(gw, request, body, session_id)


def _models(gw: Gateway) -> dict[str, Any]:
    created = int(time.time())
    model = {
        "id": gw.components.model_name,
        "object": "model",
        "created": created,
        "owned_by": "rlgateway",
    }
    return {"object": "list", "data": [model]}


@router.get("/v1/models", responses=error_docs(401, 500))
async def models(gw: GatewayDep, request: Request) -> dict[str, Any]:
    await resolve(request, gw.sessions, gw.settings.admin_token, None)
    return _models(gw)


@router.get("/sessions/{session_id}/v1/models", responses=error_docs(401, 404, 422, 500))
async def session_models(gw: GatewayDep, request: Request, session_id: str) -> dict[str, Any]:
    await resolve(request, gw.sessions, gw.settings.admin_token, session_id)
    return _models(gw)
