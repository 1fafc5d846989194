"""`/v1/chat/completions` on the turn core (`gateway.core.turn`): a chat request to a `TurnSpec`
(its messages and tools normalized to the neutral ones, `normalize_messages`), and a turn's
choices to `chat.completion` JSON or `chat.completion.chunk` events."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from gateway.core.chat_render import Message, function_tool
from gateway.core.choices import EventStream
from gateway.core.media import Media, media_of, media_text
from gateway.core.turn import TurnCore
from gateway.core.turn_run import Turn
from gateway.core.turn_types import ChatPrompt, Choice, Delta, Exchange, ToolChoice, TurnSpec
from gateway.errors import BadRequest
from gateway.protocols.common import chat_logprobs
from gateway.protocols.openai.sse import sse_stream, usage_of
from gateway.protocols.openai.types import (
    ChatCompletionRequest,
    ChatMessage,
    NamedToolChoice,
    Tool,
)
from store.run_config import RunConfig
from store.types import JSON


def _text(content: Any, where: str, media: Media) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for i, part in enumerate(content):
        if part.type == "text" and part.text is not None:
            parts.append(part.text)
        elif (placeholder := media_text(part.type, f"{where}.{i}", media)) is not None:
            parts.append(placeholder)
        else:
            raise BadRequest(
                f"{where}.{i}: content parts of type {part.type!r} are not supported: send text "
                "parts",
                param=f"{where}.{i}",
            )
    return "".join(parts)


def _arguments(raw: str | dict[str, Any]) -> Any:
    if isinstance(raw, dict):
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def normalize_messages(messages: list[ChatMessage], media: Media = "refuse") -> list[Message]:
    """Plain, comparable dicts: role, content (text), and tool_calls / tool_call_id / name."""
    out: list[Message] = []
    for i, m in enumerate(messages):
        msg: Message = {"role": "system" if m.role == "developer" else m.role}
        msg["content"] = _text(m.content, f"messages.{i}.content", media)
        if m.tool_calls:
            msg["tool_calls"] = [
                {
                    **({"id": c.id} if c.id is not None else {}),
                    "type": "function",
                    "function": {
                        "name": c.function.name,
                        "arguments": _arguments(c.function.arguments),
                    },
                }
                for c in m.tool_calls
            ]
        if m.role == "assistant" and m.reasoning_content:
            msg["reasoning_content"] = m.reasoning_content
        if m.role == "tool":
            msg["tool_call_id"] = m.tool_call_id or ""
        if m.name:
            msg["name"] = m.name
        out.append(msg)
    return out


def normalize_tools(tools: list[Tool] | None) -> list[dict[str, Any]]:
    """Chat tools as the template gets them: name, description and parameters (`strict` and
    other flags never change the prompt)."""
    return [
        function_tool(t.function.name, t.function.description, t.function.parameters)
        for t in tools or []
    ]


def chat_prompt(body: ChatCompletionRequest, media: Media = "refuse") -> ChatPrompt:
    tools = normalize_tools(body.tools)
    choice = body.tool_choice or ("auto" if tools else "none")
    if choice != "none" and not tools:
        raise BadRequest(
            "tool_choice needs tools: pass the tools to choose from", param="tool_choice"
        )
    mode: ToolChoice
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in {t["function"]["name"] for t in tools}:
            raise BadRequest(
                f"tool_choice names {name!r}, which is not in tools", param="tool_choice"
            )
        mode = ToolChoice("named", name)
    else:
        mode = ToolChoice(choice)
    one = body.parallel_tool_calls is False
    messages = normalize_messages(body.messages, media)
    variables = body.chat_template_kwargs or {}
    return ChatPrompt(messages, tools, replace(mode, parallel=not one), template_kwargs=variables)


def chat_spec(body: ChatCompletionRequest, media: Media = "refuse") -> TurnSpec:
    return TurnSpec(
        protocol="chat",
        id_prefix="chatcmpl-",
        prompts=[chat_prompt(body, media)],
        asked=body.asked(
            body.max_completion_tokens or body.max_tokens,
            (body.top_logprobs or 0) if body.logprobs else 0,
        ),
        n=body.n,
        stop=body.stop_strings(),
        stream=body.stream,
        request=body.model_dump(mode="json", exclude_none=True),
        sampling_extra={"stop": body.stop_strings(), "n": body.n},
    )


class ChatService:
    def __init__(self, core: TurnCore) -> None:
        self.core = core

    async def create(
        self,
        body: ChatCompletionRequest,
        session_id: str | None,
        *,
        run: RunConfig | None,
        retry: bool = False,
        exchange: Exchange | None = None,
    ) -> dict[str, Any] | EventStream:
        """The response (JSON), or for `stream` the SSE events, once the first piece was
        generated (`TurnCore.start`)."""
        respond = _Respond(body)
        turn = await self.core.start(
            chat_spec(body, media_of(run)),
            session_id,
            run=run,
            retry=retry,
            exchange=exchange,
            respond=respond.choice,
        )
        if body.stream:
            return EventStream(_stream(turn, body), turn.close)
        choices = await turn.complete()
        return {
            "id": turn.id,
            "object": "chat.completion",
            "created": turn.created,
            "model": turn.model,
            "choices": [respond.choice(turn, c) for c in choices],
            "usage": usage_of(turn),
            "system_fingerprint": None,
        }


class _Respond:
    def __init__(self, body: ChatCompletionRequest) -> None:
        self.body = body

    def choice(self, turn: Turn, c: Choice) -> JSON:
        message: dict[str, Any] = {"role": "assistant", "content": c.content}
        if c.reasoning is not None:
            message["reasoning_content"] = c.reasoning
        if c.tool_calls:
            message["tool_calls"] = _tool_calls(c)
        logprobs = None
        if self.body.logprobs:
            run = c.run
            logprobs = {
                "content": chat_logprobs(
                    turn.context.pieces, run.ids, run.logprobs, run.top_logprobs
                )
            }
        return {
            "index": c.index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": c.finish_reason,
            "completion_id": c.completion_id,
        }


def _tool_calls(c: Choice) -> list[dict[str, Any]]:
    return [
        {"id": t.id, "type": "function", "function": {"name": t.name, "arguments": t.arguments}}
        for t in c.tool_calls
    ]


def _delta(
    index: int, delta: dict[str, Any], logprobs: Any = None, finish: str | None = None
) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


def _stream(turn: Turn, body: ChatCompletionRequest) -> AsyncIterator[str]:
    def delta(d: Delta) -> dict[str, Any] | None:
        r = d.run
        logprobs = None
        if body.logprobs and d.hi > d.lo:
            entries = chat_logprobs(
                turn.context.pieces,
                r.ids[d.lo : d.hi],
                r.logprobs[d.lo : d.hi],
                r.top_logprobs[d.lo : d.hi],
            )
            logprobs = {"content": entries}
        out: dict[str, Any] = {}
        if d.reasoning:
            out["reasoning_content"] = d.reasoning
        if d.text:
            out["content"] = d.text
        if d.call is not None:  # a forced call's arguments, as they are sampled
            fn = {"name": d.call.name, "arguments": d.call.arguments}
            first = {"id": d.call.id, "type": "function", "function": fn}
            later = {"function": {"arguments": d.call.arguments}}
            out["tool_calls"] = [{"index": 0, **(first if d.call.opens else later)}]
        return _delta(r.index, out, logprobs) if out or logprobs is not None else None

    def closing(c: Choice) -> dict[str, Any]:
        tail: dict[str, Any] = {}
        if thought := turn.unsent_reasoning(c):
            tail["reasoning_content"] = thought
        streamed = turn.unsent_arguments(c)
        if streamed is not None:  # the first call streamed: the rest of it, then the others
            more: list[dict[str, Any]] = []
            if streamed:
                more.append({"index": 0, "function": {"arguments": streamed}})
            more += [{"index": k, **t} for k, t in enumerate(_tool_calls(c)) if k > 0]
            if more:
                tail["tool_calls"] = more
        elif c.tool_calls:
            tail["tool_calls"] = [{"index": k, **t} for k, t in enumerate(_tool_calls(c))]
        elif rest := turn.unsent(c):
            tail["content"] = rest
        return _delta(c.index, tail, None, c.finish_reason)

    opts = body.stream_options
    return sse_stream(
        turn,
        "chat.completion.chunk",
        opening=[_delta(r.index, {"role": "assistant", "content": ""}) for r in turn.runs],
        delta=delta,
        closing=closing,
        include_usage=opts is not None and opts.include_usage,
    )
