"""Anthropic's error shape, `{"type": "error", "error": {"type", "message"}}`: the envelope the
Anthropic routes declare (their route class), and the body of an error event in a stream."""

from __future__ import annotations

from typing import Any, Literal

from fastapi.routing import APIRoute
from pydantic import BaseModel

from gateway.errors import ErrorEnvelope


class AnthropicErrorDetail(BaseModel):
    type: str
    """invalid_request_error, authentication_error, not_found_error, overloaded_error, ..."""
    message: str


class AnthropicErrorBody(BaseModel):
    """Every error response's body on the Anthropic routes (Anthropic's shape)."""

    type: Literal["error"]
    error: AnthropicErrorDetail


_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error shape: `{"type": "error", "error": {"type", "message"}}`."""
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


class AnthropicEnvelope(ErrorEnvelope):
    """Anthropic answers every invalid request 400, a field's own value included."""

    body = AnthropicErrorBody
    invalid_status = 400

    def error_body(
        self, status: int, message: str, type_: str, param: str | None, code: str | None
    ) -> dict[str, Any]:
        return anthropic_error_body(status, message)


class AnthropicRoute(APIRoute):
    """A route whose errors are in Anthropic's shape (`gateway.errors.envelope_of` reads it)."""

    error_envelope: ErrorEnvelope = AnthropicEnvelope()
