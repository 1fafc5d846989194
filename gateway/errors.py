"""The gateway's exception tree and its one translation to OpenAI-shaped HTTP errors.

Routes raise these (or let engine/store errors through); `install_error_handlers` turns every one
into `{"error": {"message", "type", "param", "code"}}` with the right status, at the edge only.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

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


def error_body(message: str, type_: str, param: str | None, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _respond(exc: GatewayError) -> JSONResponse:
    headers = {}
    if isinstance(exc, TooManyRequests):
        headers["Retry-After"] = str(max(1, round(exc.retry_after)))
    if isinstance(exc, Unauthorized):
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(
        error_body(exc.message, exc.type, exc.param, exc.code),
        status_code=exc.status,
        headers=headers,
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
        return Unavailable(f"the inference engine is unavailable: {exc}")
    if isinstance(exc, NotFoundError):
        return NotFound(str(exc))
    if isinstance(exc, ConflictError):
        return Conflict(str(exc))
    log.exception("unhandled error", exc_info=exc)
    return GatewayError(f"internal error: {type(exc).__name__}")


def _validation_message(exc: RequestValidationError) -> tuple[int, str, str | None]:
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        return 400, "the request body is not valid JSON", None
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid request")
    where = f" at '{param}'" if param else ""
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return 422, f"{msg}{where}{more}", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        status, message, param = _validation_message(exc)
        return JSONResponse(
            error_body(message, "invalid_request_error", param, None), status_code=status
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(
            error_body(str(exc.detail), type_, None, None), status_code=exc.status_code
        )

    from engines.errors import EngineError
    from store.errors import StoreError

    async def _known(request: Request, exc: Exception) -> JSONResponse:
        return _respond(translate(exc))

    for cls in (GatewayError, EngineError, StoreError):
        app.add_exception_handler(cls, _known)
