"""What chat completions and completions share: their `usage`, and their stream's frame.

Both stream OpenAI's chunks (`chat.completion.chunk`, `text_completion`): the adapter's opening
chunks, one chunk per delta it keeps, after the commit one closing chunk per choice, the usage
chunk when `stream_options.include_usage` asks for it, then `data: [DONE]`. A failure after the
stream began ends it with an SSE error event and `[DONE]`, the turn recorded as aborted.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from gateway.core.turn_run import Turn
from gateway.core.turn_types import Choice, Delta
from gateway.errors import error_body, translate

DONE = "data: [DONE]\n\n"


def sse_chunk(
    obj: str,
    *,
    id: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    usage: dict[str, int] | None = None,
) -> str:
    """One server-sent event of an OpenAI stream (`chat.completion.chunk`, `text_completion`)."""
    body: dict[str, Any] = {
        "id": id,
        "object": obj,
        "created": created,
        "model": model,
        "choices": choices,
    }
    if usage is not None:
        body["usage"] = usage
    return f"data: {json.dumps(body)}\n\n"


def sse_error(exc: Exception) -> str:
    """The server-sent event of a stream that failed after it began: `{"error": {...}}` in
    OpenAI's shape (the SDK raises it as an APIError)."""
    err = translate(exc)
    return f"data: {json.dumps(error_body(err.message, err.type, err.param, err.code))}\n\n"


def usage_of(turn: Turn) -> dict[str, Any]:
    prompt, completion = turn.prompt_tokens, turn.completion_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "completion_tokens_details": {"reasoning_tokens": turn.reasoning_tokens},
    }


async def sse_stream(
    turn: Turn,
    obj: str,
    *,
    opening: list[dict[str, Any]],
    delta: Callable[[Delta], dict[str, Any] | None],
    closing: Callable[[Choice], dict[str, Any]],
    include_usage: bool,
) -> AsyncIterator[str]:
    """The turn's stream of `obj` chunks: `opening` choices first, then `delta`'s choice for
    each delta (None: nothing to send), then `closing`'s for each finished choice."""

    def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
        return sse_chunk(
            obj,
            id=turn.id,
            created=turn.created,
            model=turn.model,
            choices=choices,
            usage=usage,
        )

    try:
        for first in opening:
            yield chunk([first])
        try:
            async for d in turn.deltas():
                if (step := delta(d)) is not None:
                    yield chunk([step])
        except Exception as exc:
            # The engine (or the store) failed after the stream began: record what was
            # generated, aborted, then say so in the stream and end it cleanly.
            await turn.close()
            yield sse_error(exc)
            yield DONE
            return
        for choice in turn.choices:
            yield chunk([closing(choice)])
        if include_usage:
            yield chunk([], usage=usage_of(turn))
        yield DONE
    finally:
        await turn.close()
