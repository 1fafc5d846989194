"""`/v1/chat/completions` on the turn core (`gateway.turn`): a chat request to a `TurnSpec`, and
a turn's choices to `chat.completion` JSON or `chat.completion.chunk` events."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from gateway.chat_render import normalize_messages, normalize_tools
from gateway.choices import EventStream, chat_logprobs
from gateway.errors import BadRequest
from gateway.openai_sse import sse_stream, usage_of
from gateway.openai_types import ChatCompletionRequest, NamedToolChoice
from gateway.turn import TurnCore
from gateway.turn_run import Turn
from gateway.turn_types import ChatPrompt, Choice, Delta, ToolChoice, TurnSpec
from store.run_config import RunConfig
from store.types import JSON


def chat_prompt(body: ChatCompletionRequest) -> ChatPrompt:
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
    return ChatPrompt(normalize_messages(body.messages), tools, replace(mode, parallel=not one))


def chat_spec(body: ChatCompletionRequest) -> TurnSpec:
    return TurnSpec(
        protocol="chat",
        id_prefix="chatcmpl-",
        prompts=[chat_prompt(body)],
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
    ) -> dict[str, Any] | EventStream:
        """The response (JSON), or for `stream` the SSE events, once the first piece was
        generated (`TurnCore.start`)."""
        respond = _Respond(body)
        turn = await self.core.start(
            chat_spec(body), session_id, run=run, retry=retry, respond=respond.choice
        )
        if body.stream:
            return EventStream(_stream(turn, body), turn.close)
        choices = await turn.complete()
        return {
            "id": turn.id,
            "object": "chat.completion",
            "created": turn.created,
            "model": turn.core.model_name,
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
                "content": chat_logprobs(turn.core.pieces, run.ids, run.logprobs, run.top_logprobs)
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
                turn.core.pieces,
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
        return _delta(r.index, out, logprobs) if out or logprobs is not None else None

    def closing(c: Choice) -> dict[str, Any]:
        tail: dict[str, Any] = {}
        if thought := turn.unsent_reasoning(c):
            tail["reasoning_content"] = thought
        if c.tool_calls:
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
