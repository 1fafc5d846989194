"""The OpenAI-compatible routes, at `/v1/...` and at `/sessions/{session_id}/v1/...`.

An agent's base_url is either `.../sessions/{id}/v1` (the session rides in the path) or `.../v1`
with the session key as its API key; both are recorded into that session. The admin token may call
`/v1/...` too, unrecorded (for evaluation).

What the agent never saw is not trained: a request runs only while its client is connected (a
client that disconnects or times out aborts its generation, recorded as aborted), and a retried
non-streaming request of a session yields one turn (`gateway.attempts`: an `Idempotency-Key`, or
the openai SDK's `x-stainless-retry-count`). A replayed answer carries `Idempotent-Replayed: true`.

A session's request samples under its run's config (`gateway.sampling`); every answer says which
contract it was sampled under in `x-rlgateway-sampling` (`record` or `run`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.attempts import Key
from gateway.auth import require_active, resolve
from gateway.choices import EventStream
from gateway.deps import Gateway, GatewayDep
from gateway.errors import BadRequest, error_docs
from gateway.openai_types import ChatCompletionRequest, CompletionRequest, check_vocab
from gateway.sampling import contract_of
from store.run_config import SAMPLING_HEADER, ClientSampling

router = APIRouter(tags=["openai"])
T = TypeVar("T")

CLIENT_GONE = 499
"""The status recorded (never received) for a request whose client disconnected first."""

Result = dict[str, Any] | EventStream
Create = Callable[..., Coroutine[Any, Any, Result]]

_GENERATE_DOC: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The completion (JSON), or with `stream` its server-sent events: "
        "`data: {chunk}` events, then `data: [DONE]`; a failure after the first chunk is a "
        '`data: {"error": {...}}` event before `[DONE]`.',
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    },
    **error_docs(400, 401, 404, 409, 413, 422, 429, 500, 503),
}


class _EventStreamResponse(StreamingResponse):
    """Server-sent events that close their stream when the response ends, however it ends."""

    def __init__(self, stream: EventStream, headers: dict[str, str]) -> None:
        super().__init__(
            stream.events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers},
        )
        self.close = stream.close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.close()


def _respond(result: Result, contract: ClientSampling, *, replayed: bool = False) -> Response:
    headers: dict[str, str] = {SAMPLING_HEADER: contract}
    if isinstance(result, dict):
        if replayed:
            headers["Idempotent-Replayed"] = "true"
        return JSONResponse(result, headers=headers)
    return _EventStreamResponse(result, headers)


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away (the body was read already: nothing else comes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _while_connected(request: Request, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None when the client disconnected first (`work` is then cancelled:
    the services record what was generated, aborted)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await gone
            await asyncio.wait({task})
    if task.cancelled():
        return None
    return task.result()


def _retry_count(request: Request) -> int | None:
    raw = request.headers.get("x-stainless-retry-count")
    return int(raw) if raw is not None and raw.isdigit() else None


async def _attempt_key(request: Request, route: str, sid: str) -> tuple[Key, str] | None:
    """The request's idempotency key and the fingerprint of its body, or None when it has none."""
    body = await request.body()  # read already: the route's schema parsed it
    fingerprint = hashlib.sha256(body).hexdigest()
    key = request.headers.get("idempotency-key")
    if key is not None:
        if not 1 <= len(key) <= 255:
            raise BadRequest("Idempotency-Key must be 1 to 255 characters", param="Idempotency-Key")
        return (sid, route, "key", key), fingerprint
    if _retry_count(request) is not None:
        return (sid, route, "body", fingerprint), fingerprint
    return None


async def _generate(
    gw: Gateway,
    request: Request,
    body: ChatCompletionRequest | CompletionRequest,
    session_id: str | None,
    route: str,
    create: Create,
) -> Response:
    caller = await resolve(request, gw.sessions, gw.settings.admin_token, session_id)
    require_active(caller)
    check_vocab(body, len(gw.components.tokenizer))
    sid = caller.session.id if caller.session else None
    run = None if caller.session is None else await gw.run_configs.of(caller.session.run_id)
    contract = contract_of(run)
    count = _retry_count(request)
    retry = count is not None and count >= 1
    key = None if body.stream or sid is None else await _attempt_key(request, route, sid)
    if key is None:
        result = await _while_connected(request, create(body, sid, run=run, retry=retry))
        return Response(status_code=CLIENT_GONE) if result is None else _respond(result, contract)

    async def answer(known: bool) -> dict[str, Any]:
        # An earlier attempt known here either answered (replayed), left an aborted turn (which
        # any repeat replaces) or nothing: only an unknown one may have left a lost reply.
        result = await create(body, sid, run=run, retry=retry and not known)
        assert isinstance(result, dict), "a non-streaming request answers JSON"
        return result

    once = gw.recorder.attempts.once(key[0], key[1], answer, first=count == 0)
    replay = await _while_connected(request, once)
    if replay is None:
        return Response(status_code=CLIENT_GONE)
    response, replayed = replay
    return _respond(response, contract, replayed=replayed)


async def _chat(
    gw: Gateway, request: Request, body: ChatCompletionRequest, session_id: str | None
) -> Response:
    return await _generate(gw, request, body, session_id, "chat", gw.chat.create)


async def _completions(
    gw: Gateway, request: Request, body: CompletionRequest, session_id: str | None
) -> Response:
    return await _generate(gw, request, body, session_id, "completions", gw.completions.create)


@router.post("/v1/chat/completions", responses=_GENERATE_DOC)
async def chat_completions(
    gw: GatewayDep, request: Request, body: ChatCompletionRequest
) -> Response:
    return await _chat(gw, request, body, None)


@router.post("/sessions/{session_id}/v1/chat/completions", responses=_GENERATE_DOC)
async def session_chat_completions(
    gw: GatewayDep, request: Request, session_id: str, body: ChatCompletionRequest
) -> Response:
    return await _chat(gw, request, body, session_id)


@router.post("/v1/completions", responses=_GENERATE_DOC)
async def completions(gw: GatewayDep, request: Request, body: CompletionRequest) -> Response:
    return await _completions(gw, request, body, None)


@router.post("/sessions/{session_id}/v1/completions", responses=_GENERATE_DOC)
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
