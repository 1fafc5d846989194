"""Anthropic's `/v1/messages` on the turn core (`gateway.turn`): a Messages request to a
`TurnSpec`, and a turn's choice to a `message` object or its documented event stream.

The stream is `message_start`, `ping`, then per content block `content_block_start`,
`content_block_delta`... (`text_delta`, or one `input_json_delta` holding a tool call's whole
input, as it is known only once the call is parsed), `content_block_stop`, and last
`message_delta` (stop reason, output tokens) and `message_stop`; a failure after the stream
began is an `error` event in Anthropic's shape. `stop_reason` is `end_turn`, `max_tokens`,
`stop_sequence` (with the `stop_sequence` that matched) or `tool_use`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from gateway.chat_render import named_prefill, required_prefill
from gateway.choices import EventStream
from gateway.errors import anthropic_error_body, translate
from gateway.messages_types import (
    CountTokensRequest,
    MessagesRequest,
    neutral_messages,
    tool_choice_of,
    tool_use_id,
    tools_of,
)
from gateway.sampling import Asked
from gateway.turn import ChatPrompt, Choice, Turn, TurnCore, TurnSpec, parse_arguments
from store.run_config import RunConfig
from store.types import JSON

_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use", "stop": "end_turn"}


def messages_prompt(body: CountTokensRequest) -> ChatPrompt:
    tools = tools_of(body.tools).callable
    mode, name = tool_choice_of(body.tool_choice, {t["function"]["name"] for t in tools})
    prefill = named_prefill(name) if mode == "named" else ""
    prefill = required_prefill() if mode == "required" else prefill
    return ChatPrompt(neutral_messages(body), tools, prefill, mode != "none")


class MessagesService:
    def __init__(self, core: TurnCore) -> None:
        self.core = core

    async def count_tokens(self, body: CountTokensRequest) -> dict[str, int]:
        """The prompt's tokens, as a fresh request renders it."""
        p = messages_prompt(body)
        r = self.core.renderer
        ids = await asyncio.to_thread(r.prompt, p.messages, p.tools, p.prefill)
        return {"input_tokens": len(ids)}

    async def create(
        self,
        body: MessagesRequest,
        session_id: str | None,
        *,
        run: RunConfig | None,
        retry: bool = False,
    ) -> dict[str, Any] | EventStream:
        """The message (JSON), or for `stream` its events, once the first piece was generated
        (`TurnCore.start`)."""
        spec = TurnSpec(
            protocol="messages",
            id_prefix="msg_",
            prompts=[messages_prompt(body)],
            asked=Asked(
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=body.top_k,
                max_new_tokens=body.max_tokens,
            ),
            stop=[s for s in body.stop_sequences or () if s],
            stream=body.stream,
            request=body.model_dump(mode="json", exclude_none=True),
            cap_to_context=True,
        )
        turn = await self.core.start(spec, session_id, run=run, retry=retry, respond=message)
        if body.stream:
            return EventStream(_stream(turn), turn.close)
        return message(turn, (await turn.complete())[0])


def _stop_reason(c: Choice) -> str | None:
    if c.finish_reason == "stop" and c.stop_string is not None:
        return "stop_sequence"
    return _STOP_REASONS.get(c.finish_reason)


def _usage(turn: Turn) -> dict[str, int]:
    return {
        "input_tokens": turn.prompt_tokens,
        "output_tokens": turn.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def _blocks(c: Choice) -> list[JSON]:
    blocks: list[JSON] = []
    if c.content or not c.tool_calls:
        blocks.append({"type": "text", "text": c.content or ""})
    for call in c.tool_calls:
        args = parse_arguments(call.arguments)
        blocks.append(
            {
                "type": "tool_use",
                "id": tool_use_id(call.id),
                "name": call.name,
                "input": args if isinstance(args, dict) else {},
            }
        )
    return blocks


def message(turn: Turn, c: Choice) -> JSON:
    """The whole message of a finished (or aborted) choice: what is sent and recorded."""
    return {
        "id": turn.id,
        "type": "message",
        "role": "assistant",
        "model": turn.core.model_name,
        "content": _blocks(c),
        "stop_reason": _stop_reason(c),
        "stop_sequence": c.stop_string if _stop_reason(c) == "stop_sequence" else None,
        "usage": _usage(turn),
    }


def _event(kind: str, **fields: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"


async def _stream(turn: Turn) -> AsyncIterator[str]:
    start: JSON = {
        "id": turn.id,
        "type": "message",
        "role": "assistant",
        "model": turn.core.model_name,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": _usage(turn) | {"output_tokens": 0},
    }
    opened = False

    def open_text() -> str:
        return _event("content_block_start", index=0, content_block={"type": "text", "text": ""})

    def text(delta: str) -> str:
        return _event("content_block_delta", index=0, delta={"type": "text_delta", "text": delta})

    try:
        yield _event("message_start", message=start)
        yield _event("ping")
        try:
            async for d in turn.deltas():
                if not d.text:
                    continue
                if not opened:
                    yield open_text()
                    opened = True
                yield text(d.text)
        except Exception as exc:
            await turn.close()
            err = translate(exc)
            yield _event("error", **anthropic_error_body(err.status, err.message))
            return
        choice = turn.choices[0]
        final = message(turn, choice)
        for index, block in enumerate(final["content"]):
            if block["type"] == "text":
                if not opened:
                    yield open_text()
                if rest := turn.unsent(choice):
                    yield text(rest)
            else:
                yield _event(
                    "content_block_start", index=index, content_block=block | {"input": {}}
                )
                yield _event(
                    "content_block_delta",
                    index=index,
                    delta={"type": "input_json_delta", "partial_json": json.dumps(block["input"])},
                )
            yield _event("content_block_stop", index=index)
        yield _event(
            "message_delta",
            delta={"stop_reason": final["stop_reason"], "stop_sequence": final["stop_sequence"]},
            usage={"output_tokens": turn.completion_tokens},
        )
        yield _event("message_stop")
    finally:
        await turn.close()
