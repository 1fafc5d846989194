"""The gateway's exception tree and its one translation to HTTP errors.

Routes raise these (or let engine/store errors through); `install_error_handlers` turns every one
into an error response with the right status, at the edge only, in the envelope the route declares
(`ErrorEnvelope`): OpenAI's `{"error": {"message", "type", "param", "code"}}` unless its route class
names another (the Anthropic routes' `AnthropicRoute`, `gateway.protocols.anthropic.errors`).
Request schemas refuse what is wrong with a field's own value as a 422 (pydantic's check; 400 on
the protocol routes, as OpenAI and Anthropic answer it), and what only the request as a whole shows
(text that is not UTF-8, a tool result with no call) as a 400, raising `invalid_input(...)` in a
validator. Anything else that escapes a route, a bug, is a 500 in
the same shape, never plain text.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel
from pydantic_core import PydanticCustomError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import Scope

from engines.errors import (
    EngineUnavailableError,
    InvalidRequestError,
    PromptTooLongError,
    WeightUpdateError,
)

log = logging.getLogger(__name__)


class GatewayError(Exception):
    """An error the client gets back as OpenAI-shaped JSON."""

    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class BadRequest(GatewayError):
    status = 400
    type = "invalid_request_error"


class Unauthorized(GatewayError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class Forbidden(GatewayError):
    """A valid key whose scope does not cover the request (e.g. an agent key on an admin route)."""

    status = 403
    type = "permission_error"


class NotFound(GatewayError):
    status = 404
    type = "not_found_error"


class Conflict(GatewayError):
    status = 409
    type = "conflict_error"


class PayloadTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "payload_too_large"


class TooManyRequests(GatewayError):
    status = 429
    type = "rate_limit_error"

    def __init__(self, message: str, *, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Unavailable(GatewayError):
    status = 503
    type = "service_unavailable"

    def __init__(
        self, message: str, *, param: str | None = None, retry_after: float | None = None
    ) -> None:
        super().__init__(message, param=param)
        self.retry_after = retry_after
        """Seconds after which a retry may succeed (`Retry-After`), when known."""


def error_body(message: str, type_: str, param: str | None, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class ErrorDetail(BaseModel):
    message: str
    """What went wrong and what to do about it."""
    type: str
    """invalid_request_error, authentication_error, permission_error, not_found_error, ..."""
    param: str | None
    """The request field at fault (dotted: `messages.0.content`), when there is one."""
    code: str | None
    """A stable code for some errors (invalid_api_key, context_length_exceeded, ...)."""


class ErrorBody(BaseModel):
    """Every error response's body (OpenAI's shape)."""

    error: ErrorDetail


_STATUS_DOCS = {
    400: "Invalid request (the message names the field)",
    401: "Missing or wrong API key",
    403: "The key's scope does not cover this request",
    404: "No such run, session or completion",
    409: "Conflicts with the resource's state",
    413: "Request body too large",
    422: "A field's value is invalid (the message names the field)",
    429: "At the staleness bound: retry after Retry-After seconds",
    500: "Internal error",
    503: "The inference engine is unavailable (retry later, or elsewhere)",
}


def error_docs(
    *statuses: int, model: type[BaseModel] = ErrorBody
) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses=` declarations of these error statuses, each with `model` (`ErrorBody`,
    or a route's `ErrorEnvelope.body`)."""
    out: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        doc: dict[str, Any] = {"model": model, "description": _STATUS_DOCS[status]}
        if status in (429, 503):
            doc["headers"] = {
                "Retry-After": {
                    "description": "seconds to wait (on a 503, when the engine knows)",
                    "schema": {"type": "integer"},
                }
            }
        out[status] = doc
    return out


INVALID_INPUT = "rlgateway_invalid_input"
"""The pydantic error type of `invalid_input`: the handler answers it with 400 and its param."""


def invalid_input(message: str, param: str | None) -> PydanticCustomError:
    """Raise this from a request schema's validator for a 400 with `param` (not a 422)."""
    return PydanticCustomError(INVALID_INPUT, "{message}", {"message": message, "param": param})


class ErrorEnvelope:
    """How a route wraps its errors: OpenAI's `{"error": {...}}` unless its route class declares
    another (`error_envelope`: the protocol routes' `OpenAIRoute` and `AnthropicRoute`)."""

    body: type[BaseModel] = ErrorBody
    """The body's schema, for the API document."""
    invalid_status = 422
    """The status of a field whose own value is invalid: FastAPI's 422 on the gateway's own
    routes; OpenAI and Anthropic answer 400 (`INVALID_AS_400`)."""

    def response(
        self,
        status: int,
        message: str,
        type_: str,
        param: str | None,
        code: str | None,
        headers: dict[str, str] | None = None,
    ) -> JSONResponse:
        status = self.invalid_status if status == 422 else status
        body = self.error_body(status, message, type_, param, code)
        return JSONResponse(body, status_code=status, headers=headers)

    def error_body(
        self, status: int, message: str, type_: str, param: str | None, code: str | None
    ) -> dict[str, Any]:
        """The body of an error of this `status` (OpenAI's shape here)."""
        return error_body(message, type_, param, code)


class InvalidAs400(ErrorEnvelope):
    """OpenAI's shape and status: a field's invalid value is a 400, as OpenAI answers it (the
    SDKs raise `BadRequestError`)."""

    invalid_status = 400


OPENAI_ENVELOPE = ErrorEnvelope()
INVALID_AS_400 = InvalidAs400()


def declare_envelopes(app: FastAPI, routes: Iterable[APIRoute]) -> None:
    """Let what answers before routing (the body limit's 413) find these routes' envelopes."""
    known: list[APIRoute] = app.state.__dict__.setdefault("enveloped_routes", [])
    known.extend(routes)


def document_envelopes(app: FastAPI) -> None:
    """The API document as the envelopes answer: a route whose envelope answers invalid values
    with 400 declares no 422 (FastAPI adds its own 422, with a schema never sent, to every route
    with parameters or a body)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        spec = build()
        for route in app.state.__dict__.get("enveloped_routes", ()):
            if getattr(route, "error_envelope", OPENAI_ENVELOPE).invalid_status == 422:
                continue
            ops = spec["paths"].get(route.path_format, {})
            for method in route.methods or ():
                ops.get(method.lower(), {}).get("responses", {}).pop("422", None)
        schemas = spec.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            if f"#/components/schemas/{name}" not in json.dumps(spec["paths"]):
                schemas.pop(name, None)
        app.openapi_schema = spec
        return spec

    app.openapi = openapi  # type: ignore[method-assign]


def envelope_of(scope: Scope) -> ErrorEnvelope:
    """The error envelope of the route serving `scope`: the route routing chose, or before
    routing the first declared route (`declare_envelopes`) whose path matches; OpenAI's for any
    other path."""
    route = scope.get("route")
    if route is None and "app" in scope:
        known = scope["app"].state.__dict__.get("enveloped_routes", ())
        route = next((r for r in known if r.path_regex.match(scope["path"])), None)
    return getattr(route, "error_envelope", OPENAI_ENVELOPE)


def error_response(exc: GatewayError, scope: Scope) -> JSONResponse:
    """The response of a gateway error: its status, body (in the envelope of the route serving
    `scope`) and headers."""
    headers = {}
    if isinstance(exc, TooManyRequests | Unavailable) and exc.retry_after is not None:
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
    if isinstance(exc, Unauthorized):
        headers["WWW-Authenticate"] = "Bearer"
    return envelope_of(scope).response(
        exc.status, exc.message, exc.type, exc.param, exc.code, headers
    )


def translate(exc: Exception) -> GatewayError:
    """Map an engine or store error to the gateway error the client should see."""
    from store.errors import ConflictError, NotFoundError

    if isinstance(exc, GatewayError):
        return exc
    if isinstance(exc, PromptTooLongError):
        err = BadRequest(str(exc), param="messages")
        err.code = "context_length_exceeded"
        return err
    if isinstance(exc, InvalidRequestError):
        return BadRequest(str(exc))
    if isinstance(exc, WeightUpdateError):
        return Conflict(f"the weights were not loaded: {exc}")
    if isinstance(exc, EngineUnavailableError):
        return Unavailable(
            f"the inference engine is unavailable: {exc}", retry_after=exc.retry_after
        )
    if isinstance(exc, NotFoundError):
        return NotFound(str(exc))
    if isinstance(exc, ConflictError):
        return Conflict(str(exc))
    log.exception("unhandled error", exc_info=exc)
    return GatewayError(f"internal error: {type(exc).__name__}")


_LOCATIONS = ("body", "query", "path", "header", "cookie")


def _validation_message(exc: RequestValidationError) -> tuple[int, str, str | None]:
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        return 400, "the request body is not valid JSON", None
    for e in errors:
        if e.get("type") == INVALID_INPUT:
            return 400, str(e["ctx"]["message"]), e["ctx"]["param"]
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ())]
    if loc and loc[0] in _LOCATIONS:
        loc = loc[1:]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid request")
    where = f" at '{param}'" if param else ""
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return 422, f"{msg}{where}{more}", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        status, message, param = _validation_message(exc)
        envelope = envelope_of(request.scope)
        return envelope.response(status, message, "invalid_request_error", param, None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        code = "payload_too_large" if exc.status_code == 413 else None
        headers = dict(exc.headers or {})
        message = str(exc.detail)
        if exc.status_code == 405:
            allowed = ", ".join(allowed_methods(request))
            headers["Allow"] = allowed
            message = f"{request.method} is not allowed on {request.url.path}: use {allowed}"
        envelope = envelope_of(request.scope)
        return envelope.response(exc.status_code, message, type_, None, code, headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Starlette's outermost middleware sends this response, then re-raises for the server
        # to log; a response already under way (a stream) is cut off, as nothing can be sent.
        return error_response(GatewayError(f"internal error: {type(exc).__name__}"), request.scope)

    from engines.errors import EngineError
    from store.errors import StoreError

    async def _known(request: Request, exc: Exception) -> JSONResponse:
        return error_response(translate(exc), request.scope)

    for cls in (GatewayError, EngineError, StoreError):
        app.add_exception_handler(cls, _known)


def allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at this request's path (a 405's `Allow`). Starlette names
    only the first route that matched the path, and a path often has one route per method, so
    each method is matched against the app's routes again."""
    allowed = []
    for method in _METHODS:
        scope = {**request.scope, "method": method, "fastapi": {}}
        if any(r.matches(scope)[0] == Match.FULL for r in request.app.router.routes):
            allowed.append(method)
    return allowed


_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")
