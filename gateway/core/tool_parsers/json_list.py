"""The formats that write every call of a reply as one JSON list after an opener: Mistral's
`[TOOL_CALLS][...]`, Granite's `<|tool_call|>[...]`, Phi-4-mini's `functools[...]`; each item
`{"name": ..., "arguments": {...}}` (or `"parameters"`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from gateway.core import tool_grammars as tg
from gateway.core.tool_grammars import Marks, literal
from gateway.core.tool_parsers.base import (
    DECODER,
    CallIds,
    Parsed,
    ParsedToolCall,
    first_marker,
    json_call,
    with_calls,
)


def read_list(rest: str) -> tuple[list[ParsedToolCall], str]:
    """The calls of the JSON list `rest` starts with, and the text after it; no calls when it
    is not a list of calls."""
    try:
        items, end = DECODER.raw_decode(rest)
    except json.JSONDecodeError:
        return [], rest
    calls = []
    for item in items if isinstance(items, list) else []:
        call = json_call(item)
        if call is None:
            return [], rest
        calls.append(call)
    return calls, rest[end:]


class JsonListParser:
    """One list after the first `opener`, text before it the content. `trailing`: what may follow
    the list (`drop`: anything, dropped, as vLLM reads Mistral's; `none`: only whitespace, else
    the reply is text). A subclass names the format."""

    name = "json_list"
    call_ids: CallIds = "call"
    json_arguments = True
    opener = ""
    markers: tuple[str, ...] = ()
    call_end: str | None = None  # one list holds every call
    markup: tuple[str, ...] = ()
    trailing = "none"

    def parse(self, text: str, tools: Sequence[dict[str, Any]] = ()) -> Parsed:
        start = first_marker(text, self.markers)
        if start < 0:
            return text, []
        calls, after = read_list(text[start + len(self.opener) :].lstrip())
        if not calls or (self.trailing == "none" and after.strip()):
            return text, []
        return with_calls(text[:start], calls)

    def prefill(self, name: str | None) -> str:
        if name is None:
            return self.opener + '[{"name": "'
        return self.opener + '[{"name": ' + json.dumps(name) + ', "arguments": '

    def grammar(
        self, tools: Sequence[dict[str, Any]], name: str | None, parallel: bool, marks: Marks
    ) -> str:
        if name is not None:
            return tg.grammar(f"args {literal('}]', marks)}", tg.named(tools, name))
        # the first call's name is inside the prefill's string; the next ones are whole objects
        first = tg.any_call(tools, '{name}", "arguments": ', "}", marks, rule="first")
        more = tg.any_call(tools, ', {"name": "{name}", "arguments": ', "}", marks)
        start = f"first{' call*' if parallel else ''} {literal(']', marks)}"
        return tg.grammar(start, [first, more, *tg.arguments_rules(tools)])


class GraniteParser(JsonListParser):
    """Granite 3.x: `<|tool_call|>[...]` and nothing after (Granite 3.1/3.2 may write a plain
    `<tool_call>` instead)."""

    name = "granite"
    opener = "<|tool_call|>"
    markers: tuple[str, ...] = ("<|tool_call|>", "<tool_call>")
    markup: tuple[str, ...] = ("<|tool_call|>",)

    def parse(self, text: str, tools: Sequence[dict[str, Any]] = ()) -> Parsed:
        content, calls = super().parse(text.replace("<tool_call>", self.opener, 1), tools)
        return (content, calls) if calls else (text, [])


class Phi4MiniJsonParser(JsonListParser):
    """Phi-4-mini: `functools[...]`, text before it the content, nothing after."""

    name = "phi4_mini_json"
    opener = "functools"
    markers: tuple[str, ...] = ("functools[",)
