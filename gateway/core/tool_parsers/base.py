"""What every tool-call parser shares: the parsed call, the parser protocol, and the helpers
that read names and JSON calls (`gateway.core.tool_parsers` says how the formats are read)."""

from __future__ import annotations

import json
import secrets
import string
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from gateway.core.tool_grammars import Marks, is_text, resolved


@dataclass(frozen=True, slots=True)
class ParsedToolCall:
    name: str
    arguments: str
    """The arguments as a JSON string, as OpenAI returns them."""
    id: str | None = None
    """The call's id where the format writes one (Kimi-K2's `functions.NAME:IDX`), which the
    client then gets; None: the gateway makes one up (`new_call_id`, in the parser's
    `call_ids` style)."""


CallIds = Literal["call", "alnum9"]
"""How the gateway makes a call's id when the model wrote none: `call_` and 24 hex digits
(OpenAI's shape), or nine letters and digits (Mistral's templates refuse any other)."""

_ALNUM = string.ascii_letters + string.digits


def new_call_id(style: CallIds) -> str:
    if style == "alnum9":
        return "".join(secrets.choice(_ALNUM) for _ in range(9))
    return f"call_{uuid.uuid4().hex[:24]}"


Parsed = tuple[str | None, list[ParsedToolCall]]


class ToolCallParser(Protocol):
    name: str
    markers: tuple[str, ...]
    """Texts that may start a tool call. While a reply streams, visible text is cut at the first
    marker and a partial marker at the end is held back (so markup is never streamed as text)."""
    call_end: str | None
    """The text that ends one call, where the format has one: a turn that may make one call
    only (`parallel_tool_calls: false`) stops there, so no second call is ever sampled."""
    markup: tuple[str, ...]
    """Every tag of the format: a special token that is one of them is decoded as text, so the
    parser sees it (a tokenizer may mark `[ARGS]` or `<arg_key>` special)."""
    call_ids: CallIds
    """How the ids of its calls are made where the model writes none (`new_call_id`)."""
    json_arguments: bool
    """A call's arguments are a JSON object written whole after the name, with an id the gateway
    makes: a call forced by name streams them as they are sampled (`gateway.core.call_stream`).
    False for the keyed formats (values as bare text), Python literals, and Kimi-K2 (the model
    writes the id)."""

    def parse(self, text: str, tools: Sequence[dict[str, Any]] = ()) -> Parsed:
        """(content outside the calls, stripped, None when empty; the calls). A malformed call
        (bad JSON, no name, ...) makes the WHOLE text content with no calls, so nothing the model
        wrote is lost; text with no marker is all content. Without calls the content is `text`
        itself, unstripped. `tools` (the request's): a format that writes values as bare text
        reads a value of a `string` parameter as the text, others as JSON (`typed_value`)."""

    def prefill(self, name: str | None) -> str:
        """The text forced at the start of the reply when a tool must be called (name None: any
        tool, `tool_choice: required`; else that tool). Parsing prefill + generated text must give
        the call."""

    def grammar(
        self, tools: Sequence[dict[str, Any]], name: str | None, parallel: bool, marks: Marks
    ) -> str | None:
        """The grammar that continues `prefill(name)` (`gateway.core.tool_grammars`): the call's
        arguments held to its tool's schema and the format's closing markup (`marks`: the
        tokenizer's added tokens), then the end (more calls when `parallel` and the format
        separates them). None: the format cannot be held (Python literals), and only
        the prefill forces the call."""


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parameter_type(tools: Sequence[dict[str, Any]], function: str, key: str) -> Any:
    """The JSON-schema `type` of parameter `key` of tool `function`, a local `$ref` followed;
    `string` for an undeclared one whose `enum` or `const` is strings only (what a keyed
    format's grammar writes as bare text, `tool_grammars.is_text`); None when not declared."""
    for tool in tools:
        fn = tool.get("function", {})
        if fn.get("name") == function:
            params = fn.get("parameters") or {}
            prop = resolved((params.get("properties") or {}).get(key), params)
            if not isinstance(prop, dict):
                return None
            return "string" if is_text(prop) else prop.get("type")
    return None


def typed_value(raw: str, declared: Any) -> Any:
    """A value a format writes as bare text: the text itself for a `string` parameter, else read
    as JSON (numbers, booleans, null, arrays, objects) when it parses, else the text."""
    if declared == "string":
        return raw
    try:
        return json.loads(raw.strip(), parse_constant=_reject_constant)
    except ValueError:
        return raw


def first_marker(text: str, markers: tuple[str, ...]) -> int:
    found = [i for i in (text.find(m) for m in markers) if i >= 0]
    return min(found, default=-1)


def with_calls(content: str, calls: list[ParsedToolCall]) -> Parsed:
    return (content.strip() or None), calls


def json_call(obj: Any) -> ParsedToolCall | None:
    """`{"name": str, "arguments" or "parameters": object or JSON string}`, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ParsedToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args))


def json_object(raw: str) -> dict[str, Any] | None:
    """Arguments written as a JSON object, parsed; None when they are not one."""
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def is_name(name: str) -> bool:
    """A function name written as bare text: no whitespace, quotes, braces or angle brackets
    (so template residue like `{{ tc.name }}` is not a call)."""
    return bool(name) and not any(c in "{}<>[]\"' \t\r\n" for c in name)


DECODER = json.JSONDecoder()


class NoToolParser:
    """The chat template writes tool calls in no format a parser here knows (auto detection found
    none): a request whose calls would be read is refused with a 400 that names `--tool-parser`
    (`gateway.core.turn.TurnCore`), rather than read by a guess; without tools, or with
    `tool_choice: none`, nothing is parsed and replies are text."""

    name = "unknown"
    call_ids: CallIds = "call"
    json_arguments = False
    markers: tuple[str, ...] = ()
    call_end: str | None = None
    markup: tuple[str, ...] = ()

    def parse(self, text: str, tools: Sequence[dict[str, Any]] = ()) -> Parsed:
        return text, []

    def prefill(self, name: str | None) -> str:
        raise AssertionError("a tool call is never forced without a parser")

    def grammar(
        self, tools: Sequence[dict[str, Any]], name: str | None, parallel: bool, marks: Marks
    ) -> None:
        return None
