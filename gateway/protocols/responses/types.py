"""The Responses API's request schema (`POST /v1/responses`), and its input items as neutral
messages (`gateway.core.turn_types.ChatPrompt`).

Input items become the same neutral messages chat completions records
(`gateway.core.chat_render`): messages by role (developer as system), an assistant
message and the `function_call` items after it as one assistant message with tool calls, each
`function_call_output` as a tool message. So a conversation that moves between chat completions
and Responses continues its segment token for token.

Tools: function tools are callable (a `namespace` group's function tools too, flattened); hosted
tools (`web_search`, `file_search`, `computer_use_preview`, `mcp`, ...) and custom tools are not,
and are left out (`Tools.left_out` names them; the response says so in a header), never a 400.
Reasoning items the client returns are accepted; the encrypted content the gateway handed out
finds the exact earlier tokens again (`gateway.protocols.responses.adapter`).
"""

from __future__ import annotations

import json
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StrictBool, model_validator

from engines.base import MAX_TOP_LOGPROBS
from gateway.core.chat_render import Message, Tools, function_tool
from gateway.core.formats import format_schema
from gateway.core.media import Media, media_text
from gateway.core.reasoning_parsers import unseal_reasoning
from gateway.core.turn_types import ToolChoice, ToolMode
from gateway.errors import BadRequest, invalid_input
from gateway.limits import CheckedBody, Int, Num, TemplateVariables, TokenCount


class ResponseObject(BaseModel):
    """A response as `POST /v1/responses` answered it and `GET /v1/responses/{id}` returns it:
    these fields declared, the rest of OpenAI's response object (instructions, tools, sampling,
    metadata, ...) passed through as it was sent."""

    model_config = ConfigDict(extra="allow")
    id: str
    object: str = "response"
    created_at: int | float
    status: str
    """completed, incomplete or failed."""
    model: str
    output: list[dict[str, Any]]
    """Messages, reasoning items and function calls, in the order the model produced them."""
    usage: dict[str, Any] | None = None


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ResponsesRequest(_Open, CheckedBody, TemplateVariables):
    model: str | None = None
    input: str | list[dict[str, Any]] = Field(default_factory=list)
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    max_output_tokens: TokenCount | None = None
    temperature: Num | None = Field(None, ge=0.0, le=2.0)
    top_p: Num | None = Field(None, gt=0.0, le=1.0)
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    store: StrictBool = True
    previous_response_id: str | None = None
    stream: StrictBool = False
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    reasoning: dict[str, Any] | None = None
    seed: Int | None = Field(None, ge=0, le=2**63 - 1)
    """vLLM's extension, as on chat completions: the same seed reproduces the reply."""
    ignore_eos: StrictBool = False
    """vLLM's extension, as on chat completions: do not stop at the model's end token."""
    text: dict[str, Any] | None = None
    """`format`: `text`, `json_object` or `json_schema`, held to by grammar-constrained decoding
    (`engines.grammar`)."""
    conversation: str | dict[str, Any] | None = None
    """Not served: a 400 (the history it names would be lost)."""
    _json_schema: str | None = PrivateAttr(None)

    @property
    def json_schema(self) -> str | None:
        """The JSON schema the reply must follow (`text.format`), or None."""
        return self._json_schema

    @model_validator(mode="after")
    def _served(self) -> Self:
        if self.text is not None and not isinstance(self.text, dict):
            raise invalid_input("text must be an object", "text")
        fmt = (self.text or {}).get("format")
        self._json_schema = format_schema(fmt, "text.format", nested=False)
        if self.conversation is not None:
            raise invalid_input(
                "conversation: conversations are not kept here, so the history it names would be "
                "lost; send the history in input, or chain responses with previous_response_id",
                "conversation",
            )
        return self


# -- tools ------------------------------------------------------------------------------------


def tools_of(tools: list[dict[str, Any]] | None) -> Tools:
    callable_: list[dict[str, Any]] = []
    left_out: list[str] = []

    def walk(items: list[Any], where: str) -> None:
        for i, t in enumerate(items):
            if not isinstance(t, dict):
                raise BadRequest(f"{where}.{i} must be an object", param=f"{where}.{i}")
            kind = t.get("type")
            if kind == "function":
                name = t.get("name")
                if not isinstance(name, str) or not name:
                    raise BadRequest(
                        f"{where}.{i}.name: a function tool needs a name", param=f"{where}.{i}.name"
                    )
                callable_.append(function_tool(name, t.get("description"), t.get("parameters")))
            elif kind == "namespace" and isinstance(t.get("tools"), list):
                walk(t["tools"], f"{where}.{i}.tools")
            else:
                left_out.append(str(t.get("name") or kind))

    walk(tools or [], "tools")
    return Tools(callable_, left_out)


# -- input items ------------------------------------------------------------------------------


def _text(content: Any, where: str, media: Media = "refuse") -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where} must be a string or a list of text parts", param=where)
    parts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if (placeholder := media_text(kind, f"{where}.{i}", media)) is not None:
            parts.append(placeholder)
            continue
        if kind not in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            raise BadRequest(
                f"{where}.{i}: content of type {kind!r} is not supported: send text parts",
                param=f"{where}.{i}",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise BadRequest(f"{where}.{i}.text must be a string", param=f"{where}.{i}.text")
        parts.append(text)
    return "".join(parts)


def _arguments(raw: Any, where: str) -> Any:
    if isinstance(raw, dict):
        return raw
    if not isinstance(raw, str):
        raise BadRequest(f"{where} must be a JSON string", param=where)
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    sealed = unseal_reasoning(item.get("encrypted_content"))
    if sealed is not None:
        return sealed
    return _text(item.get("content") or [], f"{where}.content")


def input_messages(
    items: str | list[dict[str, Any]],
    *,
    open_calls: frozenset[str] = frozenset(),
    media: Media = "refuse",
) -> list[Message]:
    """The input items as normalized messages. A `function_call_output` must answer a
    `function_call` of the assistant turn before it (by `call_id`; `open_calls` are those of the
    response it chains on), as chat requires of tool messages; `reasoning` items are context the
    gateway finds its own tokens by, not messages."""
    where = "input"
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[Message] = []
    calls: set[str] = set(open_calls)
    reasoning: str | None = None  # of the assistant message the next items make

    def assistant(content: str) -> Message:
        msg: Message = {"role": "assistant", "content": content}
        if reasoning:
            msg["reasoning_content"] = reasoning
        return msg

    for i, item in enumerate(items):
        at = f"{where}.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            role = ROLES.get(str(item.get("role")))
            if role is None:
                raise BadRequest(
                    f"{at}.role must be user, assistant, system or developer", param=f"{at}.role"
                )
            content = _text(item.get("content"), f"{at}.content", media)
            out.append(
                assistant(content) if role == "assistant" else {"role": role, "content": content}
            )
            reasoning = None
            calls = set()
        elif kind == "function_call":
            call_id, name = item.get("call_id"), item.get("name")
            if not isinstance(call_id, str) or not isinstance(name, str):
                raise BadRequest(f"{at}: a function_call needs call_id and name", param=at)
            call = {
                "id": call_id,
                "type": "function",
                "function": {
                    "name": name,
                    "arguments": _arguments(item.get("arguments", "{}"), f"{at}.arguments"),
                },
            }
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant" or reasoning is not None:
                last = assistant("")
                out.append(last)
                reasoning = None
            last.setdefault("tool_calls", []).append(call)
            calls.add(call_id)
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or call_id not in calls:
                raise BadRequest(
                    f"{at}.call_id: a function_call_output must answer a function_call before "
                    f"it, by its call_id; {call_id!r} is none of {sorted(calls) or 'them'}",
                    param=f"{at}.call_id",
                )
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, f"{at}.output", media)
            out.append({"role": "tool", "content": text, "tool_call_id": call_id})
        elif kind == "reasoning":
            reasoning = _reasoning_text(item, at)
        else:
            raise BadRequest(
                f"{at}: input items of type {kind!r} are not supported: send messages, "
                "function_call, function_call_output or reasoning items",
                param=f"{at}.type",
            )
    return out


_MODES: dict[str, ToolMode] = {"none": "none", "auto": "auto", "required": "required"}


def tool_choice_of(choice: str | dict[str, Any] | None, names: set[str]) -> ToolChoice:
    """none, auto (the default), required, or a named function. With no callable tools it is
    none; a choice of a hosted tool (which the model cannot call) means auto."""
    if isinstance(choice, str) and choice not in _MODES:
        raise BadRequest("tool_choice must be none, auto or required", param="tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if not isinstance(name, str) or name not in names:
            raise BadRequest(
                f"tool_choice names {name!r}, which is not in tools", param="tool_choice"
            )
        return ToolChoice("named", str(name))
    if not names:
        return ToolChoice("none")
    if isinstance(choice, str):
        return ToolChoice(_MODES[choice])
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        return ToolChoice("required" if choice.get("mode") == "required" else "auto")
    return ToolChoice("auto")
