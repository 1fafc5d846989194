"""The OpenAI-compatible routes: chat completions, completions and models, mounted at `/v1/...`
and at `/sessions/{session_id}/v1/...` (`gateway.routes.generate.mount_protocol`).

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
from gateway.errors import NotFound, error_docs
from gateway.protocols.common import OpenAIRoute
from gateway.protocols.openai.types import (
    ChatCompletionRequest,
    CompletionRequest,
    Model,
    ModelList,
    check_vocab,
)
from gateway.routes.generate import GENERATE_DOC, generate, session_of

router = APIRouter(tags=["openai"], route_class=OpenAIRoute)


def _vocab(gw: Gateway, body: ChatCompletionRequest | CompletionRequest) -> Any:
    return lambda: check_vocab(body, len(gw.components.tokenizer))


@router.post("/v1/chat/completions", responses=GENERATE_DOC)
async def chat_completions(
    gw: GatewayDep, request: Request, body: ChatCompletionRequest
) -> Response:
    return await generate(
        gw, request, body, session_of(request), "chat", gw.chat.create, check=_vocab(gw, body)
    )


@router.post("/v1/completions", responses=GENERATE_DOC)
async def completions(gw: GatewayDep, request: Request, body: CompletionRequest) -> Response:
    create = gw.completions.create
    return await generate(
        gw, request, body, session_of(request), "completions", create, check=_vocab(gw, body)
    )


@router.get("/v1/models", responses=error_docs(401, 500))
async def models(gw: GatewayDep, request: Request) -> ModelList:
    await resolve(request, gw.sessions, gw.settings.admin_token, session_of(request))
    model = Model(id=gw.components.model_name, created=int(time.time()), parsers=gw.parsers.shown())
    return ModelList(data=[model])


@router.get("/v1/models/{model_id:path}", responses=error_docs(401, 404, 500))
async def model(gw: GatewayDep, request: Request, model_id: str) -> Model:
    """The served model by its id (ids may hold slashes, as `org/name` does); any other is 404,
    as OpenAI answers an unknown model."""
    await resolve(request, gw.sessions, gw.settings.admin_token, session_of(request))
    if model_id != gw.components.model_name:
        raise NotFound(
            f"the model {model_id!r} does not exist here: this gateway serves "
            f"{gw.components.model_name!r} (GET /v1/models lists it)"
        )
    return Model(id=model_id, created=int(time.time()), parsers=gw.parsers.shown())
