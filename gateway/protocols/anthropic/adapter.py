"""Anthropic's `/v1/messages` on the turn core (`gateway.core.turn`): a Messages request to a
`TurnSpec`, and a turn's choice to a `message` object or its documented event stream.

The stream is `message_start`, `ping`, then per content block `content_block_start`,
`content_block_delta`... (`text_delta`, or one `input_json_delta` holding a tool call's whole
input, as it is known only once the call is parsed; a forced call streams its first input as it
is sampled), `content_block_stop`, and last
`message_delta` (stop reason, output tokens) and `message_stop`; a failure after the stream
began is an `error` event in Anthropic's shape. `stop_reason` is `end_turn`, `max_tokens`,
`model_context_window_exceeded` (the model's context, not `max_tokens`, ended the reply),
`stop_sequence` (with the `stop_sequence` that matched) or `tool_use`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from gateway.core.choices import EventStream
from gateway.core.media import Media, media_of
from gateway.core.reasoning_parsers import seal_reasoning
from gateway.core.sampling import Asked
from gateway.core.turn import TurnCore
from gateway.core.turn_run import Turn
from gateway.core.turn_types import ChatPrompt, Choice, Exchange, TurnSpec, parse_arguments
from gateway.errors import translate
from gateway.protocols.anthropic.errors import anthropic_error_body
from gateway.protocols.anthropic.types import (
    CountTokensRequest,
    MessagesRequest,
    TokenCountAnswer,
    neutral_messages,
    tool_choice_of,
    tool_use_id,
    tools_of,
)
from store.run_config import RunConfig
from store.types import JSON

_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use", "stop": "end_turn"}


def messages_prompt(body: CountTokensRequest, media: Media = "refuse") -> ChatPrompt:
    """A last assistant message is the start of the reply (a prefill): the reply continues it."""
    tools = tools_of(body.tools).callable
    choice = tool_choice_of(body.tool_choice, {t["function"]["name"] for t in tools})
    messages = neutral_messages(body, media)
    last, variables = messages[-1], body.chat_template_kwargs or {}
    if last["role"] == "assistant" and not last.get("tool_calls"):
        return ChatPrompt(
            messages[:-1], tools, choice, continues=last["content"], template_kwargs=variables
        )
    return ChatPrompt(messages, tools, choice, template_kwargs=variables)


class MessagesService:
    def __init__(self, core: TurnCore) -> None:
        self.core = core

    async def count_tokens(
        self, body: CountTokensRequest, run: RunConfig | None = None
    ) -> TokenCountAnswer:
        """The prompt's tokens, as a fresh request in the caller's run renders it."""
        p = messages_prompt(body, media_of(run))
        r = self.core.renderer
        prefill = self.core.prefill(p)
        ids = await asyncio.to_thread(r.prompt, p.messages, p.tools, prefill)
        return TokenCountAnswer(input_tokens=len(ids))

    async def create(
        self,
        body: MessagesRequest,
        session_id: str | None,
        *,
        run: RunConfig | None,
        retry: bool = False,
        exchange: Exchange | None = None,
    ) -> dict[str, Any] | EventStream:
        """The message (JSON), or for `stream` its events, once the first piece was generated
        (`TurnCore.start`)."""
        spec = TurnSpec(
            protocol="messages",
            id_prefix="msg_",
            prompts=[messages_prompt(body, media_of(run))],
            asked=Asked(
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=body.top_k,
                max_new_tokens=body.max_tokens,
                seed=body.seed,
                ignore_eos=body.ignore_eos,
                json_schema=body.json_schema,
            ),
            stop=[s for s in body.stop_sequences or () if s],
            stream=body.stream,
            request=body.model_dump(mode="json", exclude_none=True),
            cap_to_context=True,
        )
        turn = await self.core.start(
            spec, session_id, run=run, retry=retry, exchange=exchange, respond=message
        )
        if body.stream:
            return EventStream(_stream(turn), turn.close)
        return message(turn, (await turn.complete())[0])


def _stop_reason(c: Choice) -> str | None:
    if c.finish_reason == "stop" and c.stop_string is not None:
        return "stop_sequence"
    if c.context_edge:  # Anthropic's own reason for a reply the context window cut
        return "model_context_window_exceeded"
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
    if c.reasoning is not None:
        blocks.append(
            {"type": "thinking", "thinking": c.reasoning, "signature": seal_reasoning(c.reasoning)}
        )
    if c.content or not c.tool_calls:
        text = c.content or ""
        blocks.append({"type": "text", "text": text.removeprefix(c.continued)})
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
        "model": turn.model,
        "content": _blocks(c),
        "stop_reason": _stop_reason(c),
        "stop_sequence": c.stop_string if _stop_reason(c) == "stop_sequence" else None,
        "usage": _usage(turn),
    }


def _event(kind: str, **fields: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"


class _Blocks:
    """The content-block events of one streamed message, in order: thinking, text, tool uses."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None

    def start(self, block: JSON) -> str:
        self.index += 1
        self.open = str(block["type"])
        return _event("content_block_start", index=self.index, content_block=block)

    def delta(self, delta: JSON) -> str:
        return _event("content_block_delta", index=self.index, delta=delta)

    def stop(self) -> str:
        self.open = None
        return _event("content_block_stop", index=self.index)

    def thinking(self, text: str) -> list[str]:
        out = [] if self.open == "thinking" else [self.start(_EMPTY["thinking"])]
        return [*out, self.delta({"type": "thinking_delta", "thinking": text})]

    def text(self, text: str) -> list[str]:
        out: list[str] = []
        if self.open != "text":
            out.append(self.start(_EMPTY["text"]))
        if text:
            out.append(self.delta({"type": "text_delta", "text": text}))
        return out


_EMPTY: dict[str, JSON] = {
    "thinking": {"type": "thinking", "thinking": "", "signature": ""},
    "text": {"type": "text", "text": ""},
}


async def _stream(turn: Turn) -> AsyncIterator[str]:
    start: JSON = {
        "id": turn.id,
        "type": "message",
        "role": "assistant",
        "model": turn.model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": _usage(turn) | {"output_tokens": 0},
    }
    blocks = _Blocks()
    thought = ""

    def end_thinking(signature: str) -> list[str]:
        return [blocks.delta({"type": "signature_delta", "signature": signature}), blocks.stop()]

    try:
        yield _event("message_start", message=start)
        yield _event("ping")
        try:
            async for d in turn.deltas():
                if d.reasoning:
                    thought += d.reasoning
                    for e in blocks.thinking(d.reasoning):
                        yield e
                if d.text:
                    if blocks.open == "thinking":
                        for e in end_thinking(seal_reasoning(thought)):
                            yield e
                    for e in blocks.text(d.text):
                        yield e
                if d.call is not None:  # a forced call's input, as it is sampled
                    if d.call.opens:
                        if blocks.open == "thinking":
                            for e in end_thinking(seal_reasoning(thought)):
                                yield e
                        use = {"type": "tool_use", "id": tool_use_id(d.call.id)}
                        yield blocks.start(use | {"name": d.call.name, "input": {}})
                    yield blocks.delta(
                        {"type": "input_json_delta", "partial_json": d.call.arguments}
                    )
        except Exception as exc:
            await turn.close()
            err = translate(exc)
            yield _event("error", **anthropic_error_body(err.status, err.message))
            return
        choice = turn.choices[0]
        final = message(turn, choice)
        streamed = turn.unsent_arguments(choice)
        open_use = blocks.open == "tool_use"  # the first call, streamed as it was sampled
        for block in final["content"]:
            kind = block["type"]
            if streamed is not None and kind == "text":
                continue  # a forced reply has no text but a call its limit cut
            if open_use and kind == "tool_use":
                open_use = False
                if streamed:
                    yield blocks.delta({"type": "input_json_delta", "partial_json": streamed})
                yield blocks.stop()
                continue
            if kind == "thinking":
                if rest := turn.unsent_reasoning(choice):
                    for e in blocks.thinking(rest):
                        yield e
                elif blocks.open != "thinking" and blocks.index < 0:
                    yield blocks.start(_EMPTY["thinking"])
                if blocks.open == "thinking":
                    for e in end_thinking(block["signature"]):
                        yield e
            elif kind == "text":
                for e in blocks.text(turn.unsent(choice)):
                    yield e
                yield blocks.stop()
            else:
                yield blocks.start(block | {"input": {}})
                yield blocks.delta(
                    {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
                )
                yield blocks.stop()
        if blocks.open == "tool_use":  # the streamed call's block (cut by its limit: unfinished)
            yield blocks.stop()
        yield _event(
            "message_delta",
            delta={"stop_reason": final["stop_reason"], "stop_sequence": final["stop_sequence"]},
            usage={"output_tokens": turn.completion_tokens},
        )
        yield _event("message_stop")
    finally:
        await turn.close()
