"""What the gateway accepts at its edge, beyond each field's own type: the request body's size,
the range of integers, and JSON text that can be tokenized, stored and written back.

- `BodyLimit`: 413 for a body over the limit, whether its length was declared or it streamed in.
- `MAX_INT32`: the largest integer a request may carry where it reaches the store's integer
  columns (32-bit on PostgreSQL) or an engine's token ids, lengths and top-k.
- `TemplateVariables`: a request's `chat_template_kwargs` (vLLM's extension, on every protocol),
  refused where a variable is one of `apply_chat_template`'s own arguments.
- `CheckedBody`: the base of JSON request bodies. Python's JSON parser accepts what cannot be
  written back (a lone UTF-16 surrogate such as `"\\ud800"`, which no UTF-8 text holds, and
  `NaN`/`Infinity`); such a body is refused whole, with a 400 naming the field, before any of it
  is rendered, tokenized or recorded.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from fastapi import HTTPException
from pydantic import BaseModel, Field, Strict, model_validator
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import PayloadTooLarge, error_response, invalid_input

MAX_INT32 = 2**31 - 1
"""Integers in requests that reach the store's INTEGER columns or an engine stay within this."""

Int = Annotated[int, Strict()]
"""An integer, not a boolean, float or string (every protocol's schemas use these)."""
Num = Annotated[float, Strict(), Field(allow_inf_nan=False)]
"""A finite number (an integer is one), not a boolean or string."""
TokenCount = Annotated[int, Strict(), Field(ge=1, le=MAX_INT32)]
"""A count of tokens: 1 to 2^31-1."""
TokenId = Annotated[int, Strict(), Field(ge=0, le=MAX_INT32)]
"""A token id: 0 to 2^31-1 (`check_vocab` holds it to the model's vocabulary)."""

MAX_GENERATIONS = 16
"""Completions one request may ask for: `n`, and prompts x `n` for a list of prompts."""


class BodyLimit:
    """413 for request bodies over `limit` bytes, declared or streamed, before a route sees them.

    A streamed body is counted as it is read: past the limit, reading it raises FastAPI's
    `HTTPException(413)`, which FastAPI re-raises as it is (any other error while it reads a body
    becomes its 400) and the error handlers answer in the route's envelope."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await error_response(PayloadTooLarge(self._message()), scope)(scope, receive, send)
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise HTTPException(413, self._message())
            return message

        await self.app(scope, limited, send)

    def _message(self) -> str:
        return (
            f"request body is larger than {self.limit} bytes: send less (or raise max_body_bytes)"
        )


def _bad_text(s: str) -> bool:
    if s.isascii():
        return False
    try:
        s.encode("utf-8")  # faster than searching for surrogates
    except UnicodeEncodeError:
        return True
    return False


def _bad(value: Any) -> bool:
    return (isinstance(value, str) and _bad_text(value)) or (
        isinstance(value, float) and not math.isfinite(value)
    )


def _clean(data: Any) -> bool:
    """Whether parsed JSON `data` holds only UTF-8 text and finite numbers (the fast pass)."""
    stack = [data]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            if any(_bad_text(k) for k in value):
                return False
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
        elif _bad(value):
            return False
    return True


def _first_bad(data: Any) -> tuple[tuple[str | int, ...], Any, bool]:
    """The path to a bad value in `data` (which `_clean` refused), the value, and whether it is
    a dict's key."""
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            for k, v in value.items():
                if _bad_text(k):
                    return path, k, True
                stack.append(((*path, k), v))
        elif isinstance(value, list):
            stack.extend(((*path, i), v) for i, v in enumerate(value))
        elif _bad(value):
            return path, value, False
    raise AssertionError("_first_bad on clean data")


def check_json(data: Any) -> None:
    """Raise `invalid_input` (a 400) naming the first string or key that is not UTF-8 text (a
    lone surrogate) or number that is not finite, anywhere in parsed JSON `data`. Iterative:
    nesting as deep as the JSON parser allows does not exhaust the stack."""
    if _clean(data):
        return
    path, value, is_key = _first_bad(data)
    where = ".".join(str(p) for p in path) or None
    at = where or "the body"
    if isinstance(value, float):
        raise invalid_input(f"{at} is {value}: JSON numbers must be finite", where)
    raise invalid_input(
        f"{'a key in ' if is_key else ''}{at} is not valid UTF-8 text (it holds a lone UTF-16 "
        "surrogate, such as \\ud800): send text whose surrogates come in pairs",
        where,
    )


class CheckedBody(BaseModel):
    """A JSON request body that `check_json` passed, whole, before its fields are validated."""

    @model_validator(mode="before")
    @classmethod
    def _checked(cls, data: Any) -> Any:
        check_json(data)
        return data


RENDERING_ARGUMENTS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
"""`apply_chat_template`'s own arguments, which a request's template variables may not set."""


class TemplateVariables(BaseModel):
    chat_template_kwargs: dict[str, Any] | None = None
    """vLLM's extension: variables for the model's chat template (`enable_thinking`, DeepSeek's
    `thinking`, gpt-oss's `reasoning_effort`, ...)."""

    @model_validator(mode="after")
    def _template_variables_are_the_templates(self) -> Any:
        taken = sorted(set(self.chat_template_kwargs or ()) & RENDERING_ARGUMENTS)
        if taken:
            raise invalid_input(
                f"chat_template_kwargs.{taken[0]}: the gateway sets this argument of the "
                "rendering itself; pass only the template's own variables (enable_thinking, ...)",
                f"chat_template_kwargs.{taken[0]}",
            )
        return self
