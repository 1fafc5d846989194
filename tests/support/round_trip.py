"""What the per-family round-trip tests share: a tool declared in each protocol's shape, and the
second turn of a conversation, which sends the first turn's answer back with the tool's result
(as an agent does) in that protocol."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

Post = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]
"""POST a body to a session's `/v1/{route}`; the answer's JSON (a 200 asserted)."""


def tools_in(protocol: str, name: str, description: str, schema: dict[str, Any]) -> list[Any]:
    """One function tool as `chat/completions`, `responses` or `messages` declares it."""
    if protocol == "chat/completions":
        fn = {"name": name, "description": description, "parameters": schema}
        return [{"type": "function", "function": fn}]
    if protocol == "responses":
        return [
            {"type": "function", "name": name, "description": description, "parameters": schema}
        ]
    return [{"name": name, "description": description, "input_schema": schema}]


async def send_result(
    post: Post, protocol: str, ask: dict[str, Any], first: dict[str, Any], tools: list[Any]
) -> str:
    """The next turn after `first` (an answer whose one call asked for the tool): the history,
    the answer as the protocol gave it, and the tool's result "sunny"; its id."""
    if protocol == "chat/completions":
        message = first["choices"][0]["message"]
        [call] = message["tool_calls"]
        result = {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}
        history = [ask, {k: v for k, v in message.items() if v is not None}, result]
        body = {"messages": history, "tools": tools, "max_tokens": 2}
    elif protocol == "responses":
        [call] = [item for item in first["output"] if item["type"] == "function_call"]
        output = {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}
        body = {
            "input": [ask, *first["output"], output],
            "tools": tools,
            "max_output_tokens": 2,
            "store": False,
        }
    else:
        [use] = [block for block in first["content"] if block["type"] == "tool_use"]
        result = {"type": "tool_result", "tool_use_id": use["id"], "content": "sunny"}
        history = [
            ask,
            {"role": "assistant", "content": first["content"]},
            {"role": "user", "content": [result]},
        ]
        body = {"messages": history, "tools": tools, "max_tokens": 2}
    second = await post(protocol, body)
    return str(second["id"])
