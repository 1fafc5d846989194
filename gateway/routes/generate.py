"""The edge every generation route shares (chat, completions, Responses, Messages).

A request runs only while its client is connected (a client that disconnects or times out aborts
its generation, recorded as aborted), and a retried non-streaming request of a session yields one
turn (`gateway.core.attempts`: an `Idempotency-Key`, or the openai and anthropic SDKs'
`x-stainless-retry-count`). A replayed answer carries `Idempotent-Replayed: true`. Every answer
says which sampling contract it was sampled under in `x-rlgateway-sampling` (`record` or `run`),
and an answer of a run that caps turns at its `max_tokens` N says `x-rlgateway-max-tokens:
capped N` (`store.run_config`, the turn budget).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect
from collections.abc import Awaitable, Callable, Coroutine
from typing import Annotated, Any, Protocol, TypeVar
from urllib.parse import quote

from fastapi import APIRouter, Depends, FastAPI, Path, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from starlette.types import Receive, Scope, Send

from gateway.auth import require_active, resolve
from gateway.core.attempts import Key
from gateway.core.choices import EventStream
from gateway.core.sampling import contract_of, max_tokens_cap
from gateway.core.turn_types import Exchange
from gateway.deps import Gateway
from gateway.errors import BadRequest, declare_envelopes, error_docs
from store.run_config import MAX_TOKENS_HEADER, SAMPLING_HEADER, RunConfig

T = TypeVar("T")

CLIENT_GONE = 499
"""The status recorded (never received) for a request whose client disconnected first."""

Result = dict[str, Any] | EventStream
Create = Callable[..., Coroutine[Any, Any, Result]]

GENERATE_DOC: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The completion (JSON), or with `stream` its server-sent events: "
        "`data: {chunk}` events, then `data: [DONE]`; a failure after the first chunk is a "
        '`data: {"error": {...}}` event before `[DONE]`.',
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    },
    **error_docs(400, 401, 404, 409, 413, 429, 500, 503),
}


SESSION_PREFIX = "/sessions/{session_id}"
"""Where each protocol's routes are mounted a second time: the session rides in the path."""


def session_of(request: Request) -> str | None:
    """The session a protocol route was called in: the `{session_id}` of its path under
    `SESSION_PREFIX`, else None (the API key then says which session, if any)."""
    return request.path_params.get("session_id")


def _session_path(
    session_id: Annotated[str, Path(description="The session the request is recorded into.")],
) -> None:
    """Declares the session mount's path parameter (for validation and the API document)."""


def mount_protocol(app: FastAPI, router: APIRouter) -> None:
    """A protocol's routes at `/v1/...` and again under `/sessions/{session_id}`: one handler
    per operation, which reads the session from the path with `session_of`. The session routes
    are routes of their own (with their whole path as their template, which the metrics label
    requests by), not the same router included under a prefix; each keeps every setting of its
    `/v1` twin (response class, models, schema flags, limits), copied by `_route_settings`."""
    app.include_router(router)
    sessions = APIRouter(dependencies=[Depends(_session_path)], responses=error_docs(404))
    for route in router.routes:
        if not isinstance(route, APIRoute):
            raise TypeError(f"{route!r}: a protocol's router holds API routes only")
        settings = _route_settings(route)
        sessions.add_api_route(SESSION_PREFIX + route.path, route.endpoint, **settings)
    app.include_router(sessions)
    declare_envelopes(app, [*router.routes, *sessions.routes])  # type: ignore[list-item]


# what `add_api_route` takes that a route holds under the same name, but its place
_PLACE = {"self", "path", "endpoint", "operation_id"}
_ROUTE_SETTINGS = tuple(
    name
    for name in inspect.signature(APIRouter.add_api_route).parameters
    if name not in _PLACE and name in inspect.signature(APIRoute.__init__).parameters
)


def _route_settings(route: APIRoute) -> dict[str, Any]:
    """Every setting of `route` that `add_api_route` takes back (its dependencies and tags
    include its router's, which is how the session copy keeps them), and its class (which
    declares its error envelope); the operation id is left to be generated from the session path,
    so that the two stay distinct in the API document."""
    settings = {name: getattr(route, name) for name in _ROUTE_SETTINGS}
    settings["methods"] = sorted(route.methods or ())
    settings["route_class_override"] = type(route)
    return settings


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


def run_headers(run: RunConfig | None) -> dict[str, str]:
    """What every answer of a request under `run` (None: outside any run) says of how it was
    sampled: the contract, and the run's cap on new tokens when it sets one."""
    headers: dict[str, str] = {SAMPLING_HEADER: contract_of(run)}
    cap = max_tokens_cap(run)
    if cap is not None:
        headers[MAX_TOKENS_HEADER] = f"capped {cap}"
    return headers


def _respond(
    result: Result, sampled: dict[str, str], extra: dict[str, str], *, replayed: bool = False
) -> Response:
    headers: dict[str, str] = {**sampled, **extra}
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


LEFT_OUT_HEADER = "x-rlgateway-tools-left-out"
"""Names the tools of a request the model cannot call, which were left out of its prompt."""


def left_out_headers(names: list[str]) -> dict[str, str]:
    """The header naming `names`, each percent-encoded (UTF-8) past printable ASCII and the
    comma, so that any name a client sends (non-Latin-1, CR/LF) makes a valid header, never a
    failed answer after its turn was recorded."""
    safe = "".join(c for c in map(chr, range(0x21, 0x7F)) if c not in ",%")
    return {LEFT_OUT_HEADER: ", ".join(quote(n, safe=safe) for n in names)} if names else {}


class Generation(Protocol):
    """A generation request of any protocol."""

    stream: bool


async def generate(
    gw: Gateway,
    request: Request,
    body: Generation,
    session_id: str | None,
    route: str,
    create: Create,
    *,
    check: Callable[[], None] | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    """Authenticate, then answer `body` by `create(body, session_id, run=, retry=, exchange=)`
    while the client is connected. `check` runs after authentication (a check that needs the
    model); `headers` are added to the answer, and so are those the turn adds (a side request's,
    `Exchange.answer_headers`)."""
    caller = await resolve(request, gw.sessions, gw.settings.admin_token, session_id)
    require_active(caller)
    if check is not None:
        check()
    sid = caller.session.id if caller.session else None
    run = None if caller.session is None else await gw.run_configs.of(caller.session.run_id)
    sampled = run_headers(run)
    count = _retry_count(request)
    retry = count is not None and count >= 1
    key = None if body.stream or sid is None else await _attempt_key(request, route, sid)
    exchange = Exchange(request.headers)
    if key is None:
        result = await _while_connected(
            request, create(body, sid, run=run, retry=retry, exchange=exchange)
        )
        if result is None:
            return Response(status_code=CLIENT_GONE)
        return _respond(result, sampled, {**(headers or {}), **exchange.answer_headers})

    async def answer(known: bool) -> dict[str, Any]:
        # An earlier attempt known here either answered (replayed), left an aborted turn (which
        # any repeat replaces) or nothing: only an unknown one may have left a lost reply.
        result = await create(body, sid, run=run, retry=retry and not known, exchange=exchange)
        assert isinstance(result, dict), "a non-streaming request answers JSON"
        return {"body": result, "headers": dict(exchange.answer_headers)}

    once = gw.recorder.attempts.once(key[0], key[1], answer, first=count == 0)
    replay = await _while_connected(request, once)
    if replay is None:
        return Response(status_code=CLIENT_GONE)
    answered, replayed = replay  # a replay answers with the first attempt's headers too
    extra = {**(headers or {}), **answered["headers"]}
    return _respond(answered["body"], sampled, extra, replayed=replayed)
