"""Anthropic Messages' request schemas (`POST /v1/messages`, `/v1/messages/count_tokens`), and
their content blocks as neutral messages (`gateway.core.turn_types.ChatPrompt`).

Blocks become the same neutral messages chat completions records (`gateway.core.chat_render`):
an assistant message's `text` blocks are its content and its `tool_use` blocks its tool calls; a
user message's `tool_result` blocks are tool messages (in order), and its text blocks a user message
after them. `system` (a string or text blocks, joined by newlines) is the first message. Tool-use
ids are the gateway's own call ids with Anthropic's `toolu_` prefix, so a conversation that moves
between Messages and the OpenAI protocols continues its segment token for token.

An assistant's `thinking` blocks are its reasoning (`reasoning_content`); `cache_control`,
`thinking`, `context_management`, `output_config` and `metadata` are accepted (`output_format`
and `output_config.format` hold the reply to a JSON schema); tools the model
cannot call (Anthropic's server and computer tools, which have no `input_schema`) are left out,
never a 400.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StrictBool, model_validator

from gateway.core.chat_render import Message, Tools, function_tool
from gateway.core.formats import format_schema
from gateway.core.media import Media, media_text
from gateway.core.turn_types import ToolChoice, ToolMode
from gateway.errors import BadRequest, invalid_input
from gateway.limits import CheckedBody, Int, Num, TemplateVariables, TokenCount

CALL_PREFIX, TOOLU_PREFIX = "call_", "toolu_"


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class AnthropicMessage(_Open):
    role: str
    content: str | list[dict[str, Any]]


class CountTokensRequest(_Open, CheckedBody, TemplateVariables):
    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None


class TokenCountAnswer(BaseModel):
    """`POST /v1/messages/count_tokens`: the prompt's tokens, as a fresh request renders it."""

    input_tokens: int


class MessagesRequest(CountTokensRequest):
    max_tokens: TokenCount
    """A limit, not a demand: capped at the room the prompt leaves in the model's context."""
    stop_sequences: list[str] | None = None
    temperature: Num | None = Field(None, ge=0.0, le=1.0)
    top_p: Num | None = Field(None, gt=0.0, le=1.0)
    top_k: Int | None = Field(None, ge=0)
    stream: StrictBool = False
    seed: Int | None = Field(None, ge=0, le=2**63 - 1)
    """vLLM's extension, as on chat completions: the same seed reproduces the reply."""
    ignore_eos: StrictBool = False
    """vLLM's extension, as on chat completions: do not stop at the model's end token."""
    output_format: dict[str, Any] | None = None
    """Structured outputs (`{"type": "json_schema", "schema": ...}`; also as
    `output_config.format`): the reply is held to the schema (`gateway.core.formats`)."""
    _json_schema: str | None = PrivateAttr(None)

    @property
    def json_schema(self) -> str | None:
        """The JSON schema the reply must follow, or None."""
        return self._json_schema

    @model_validator(mode="after")
    def _structured_output(self) -> Self:
        config = (self.model_extra or {}).get("output_config")
        shape = config.get("format") if isinstance(config, dict) else None
        if self.output_format is not None and shape is not None:
            raise invalid_input(
                "output_format and output_config.format both ask for a format: send one",
                "output_format",
            )
        if shape is not None:
            self._json_schema = format_schema(shape, "output_config.format", nested=False)
        else:
            self._json_schema = format_schema(self.output_format, "output_format", nested=False)
        return self


def tool_use_id(call_id: str) -> str:
    """A tool call's id as Anthropic's tool-use id: the gateway's `call_X` as `toolu_X`; an id
    the model wrote itself (Kimi-K2's `functions.NAME:IDX`) as it is, so that it comes back."""
    if call_id.startswith(CALL_PREFIX):
        return TOOLU_PREFIX + call_id.removeprefix(CALL_PREFIX)
    return call_id


def call_id_of(use_id: str) -> str:
    """The gateway's call id behind a tool-use id it handed out (any other id as it is)."""
    if use_id.startswith(TOOLU_PREFIX):
        return CALL_PREFIX + use_id.removeprefix(TOOLU_PREFIX)
    return use_id


def tools_of(tools: list[dict[str, Any]] | None) -> Tools:
    callable_: list[dict[str, Any]] = []
    left_out: list[str] = []
    for i, t in enumerate(tools or []):
        name = t.get("name")
        if not isinstance(name, str) or not name:
            raise BadRequest(f"tools.{i}.name: a tool needs a name", param=f"tools.{i}.name")
        if t.get("type") not in (None, "custom") or "input_schema" not in t:
            left_out.append(name)
            continue
        callable_.append(function_tool(name, t.get("description"), t["input_schema"]))
    return Tools(callable_, left_out)


def _block_text(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise BadRequest(f"{where}.text must be a string", param=f"{where}.text")
    return text


def _text(content: Any, where: str, media: Media = "refuse") -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if not isinstance(content, list):
        raise BadRequest(f"{where} must be a string or a list of text blocks", param=where)
    parts = []
    for i, b in enumerate(content):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            parts.append(_block_text(b, f"{where}.{i}"))
        elif (placeholder := media_text(kind, f"{where}.{i}", media)) is not None:
            parts.append(placeholder)
        else:
            raise BadRequest(
                f"{where}.{i}: blocks of type {kind!r} are not supported here: send text",
                param=f"{where}.{i}",
            )
    return "".join(parts)


def system_text(system: str | list[dict[str, Any]] | None) -> str:
    if isinstance(system, list):
        return "\n".join(_block_text(b, f"system.{i}") for i, b in enumerate(system))
    return system or ""


def neutral_messages(body: CountTokensRequest, media: Media = "refuse") -> list[Message]:
    """The request's system prompt and messages as normalized messages. A `tool_result` must
    answer a `tool_use` of the assistant message just before it, by its id."""
    out: list[Message] = []
    if system := system_text(body.system):
        out.append({"role": "system", "content": system})
    uses: set[str] = set()
    for i, m in enumerate(body.messages):
        at = f"messages.{i}"
        if m.role == "system":  # the SDK's `SystemMessageParam`: a system turn where it stands
            out.append({"role": "system", "content": _text(m.content, f"{at}.content", media)})
            uses = set()
            continue
        if m.role not in ("user", "assistant"):
            raise BadRequest(f"{at}.role must be user, assistant or system", param=f"{at}.role")
        blocks = [{"type": "text", "text": m.content}] if isinstance(m.content, str) else m.content
        texts: list[str] = []
        thoughts: list[str] = []
        calls: list[dict[str, Any]] = []
        results: list[Message] = []
        for j, b in enumerate(blocks):
            where = f"{at}.content.{j}"
            kind = b.get("type")
            if kind == "text":
                texts.append(_block_text(b, where))
            elif kind == "thinking" and m.role == "assistant":
                thought = b.get("thinking")
                if not isinstance(thought, str):
                    raise BadRequest(
                        f"{where}.thinking must be a string", param=f"{where}.thinking"
                    )
                thoughts.append(thought)
            elif kind == "redacted_thinking":
                continue
            elif m.role == "user" and (placeholder := media_text(kind, where, media)) is not None:
                texts.append(placeholder)
            elif kind == "tool_use" and m.role == "assistant":
                use_id, name, args = b.get("id"), b.get("name"), b.get("input", {})
                if not isinstance(use_id, str) or not isinstance(name, str):
                    raise BadRequest(f"{where}: a tool_use needs an id and a name", param=where)
                if not isinstance(args, dict):
                    raise BadRequest(f"{where}.input must be an object", param=f"{where}.input")
                calls.append(
                    {
                        "id": call_id_of(use_id),
                        "type": "function",
                        "function": {"name": name, "arguments": args},
                    }
                )
                uses.add(use_id)
            elif kind == "tool_result" and m.role == "user":
                use_id = b.get("tool_use_id")
                if not isinstance(use_id, str) or use_id not in uses:
                    raise BadRequest(
                        f"{where}.tool_use_id: a tool_result must answer a tool_use of the "
                        f"assistant message before it; {use_id!r} is none of "
                        f"{sorted(uses) or 'them (there are none)'}",
                        param=f"{where}.tool_use_id",
                    )
                content = _text(b.get("content"), f"{where}.content", media)
                results.append(
                    {"role": "tool", "content": content, "tool_call_id": call_id_of(use_id)}
                )
            else:
                raise BadRequest(
                    f"{where}: blocks of type {kind!r} are not supported in a {m.role} message: "
                    "send text, tool_use (assistant), tool_result (user) or thinking",
                    param=f"{where}.type",
                )
        if m.role == "assistant":
            msg: Message = {"role": "assistant", "content": "".join(texts)}
            if thoughts:
                msg["reasoning_content"] = "".join(thoughts)
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
            continue
        uses = set()
        out.extend(results)
        if texts or not results:
            out.append({"role": "user", "content": "".join(texts)})
    return out


_MODES: dict[str, ToolMode] = {"auto": "auto", "any": "required", "none": "none"}


def tool_choice_of(choice: dict[str, Any] | None, names: set[str]) -> ToolChoice:
    """auto (the default), any (some tool: required), tool (that one: named) or none; with
    `disable_parallel_tool_use`, one call at most."""
    parallel = not (choice or {}).get("disable_parallel_tool_use")
    return replace(_tool_choice(choice, names), parallel=parallel)


def _tool_choice(choice: dict[str, Any] | None, names: set[str]) -> ToolChoice:
    kind = "auto" if choice is None else choice.get("type")
    if kind not in ("auto", "any", "tool", "none"):
        raise BadRequest(
            "tool_choice.type must be auto, any, tool or none", param="tool_choice.type"
        )
    if not names:
        if kind in ("tool", "any"):
            raise BadRequest(
                f"tool_choice {kind!r} needs tools the model can call", param="tool_choice"
            )
        return ToolChoice("none")
    if kind == "tool":
        name = (choice or {}).get("name")
        if not isinstance(name, str) or name not in names:
            raise BadRequest(
                f"tool_choice names {name!r}, which is not in tools", param="tool_choice.name"
            )
        return ToolChoice("named", str(name))
    return ToolChoice(_MODES[str(kind)])
