"""mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (v3), or
`[TOOL_CALLS]NAME[ARGS]{...}` repeated (v11 and later)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from gateway.core import tool_grammars as tg
from gateway.core.tool_grammars import Marks, literal
from gateway.core.tool_parsers.base import (
    DECODER,
    Parsed,
    ParsedToolCall,
    first_marker,
    is_name,
    json_call,
    with_calls,
)


class MistralParser:
    """Both forms after the first `[TOOL_CALLS]`: a JSON array (text after it is dropped, as vLLM
    does), or `NAME[ARGS]{...}` per `[TOOL_CALLS]` (or `NAME{...}` when the tokenizer decoded
    `[ARGS]` away)."""

    name = "mistral"
    markers: tuple[str, ...] = ("[TOOL_CALLS]",)
    call_end: str | None = None  # one array holds every call
    markup: tuple[str, ...] = ("[TOOL_CALLS]", "[ARGS]")

    def parse(self, text: str, tools: Sequence[dict[str, Any]] = ()) -> Parsed:
        start = first_marker(text, self.markers)
        if start < 0:
            return text, []
        rest = text[start + len(self.markers[0]) :].lstrip()
        calls = self._array(rest) if rest.startswith("[") else self._named(rest)
        return with_calls(text[:start], calls) if calls else (text, [])

    @staticmethod
    def _array(rest: str) -> list[ParsedToolCall]:
        try:
            items, _ = DECODER.raw_decode(rest)
        except json.JSONDecodeError:
            return []
        calls = []
        for item in items if isinstance(items, list) else []:
            call = json_call(item)
            if call is None:
                return []
            calls.append(call)
        return calls

    @staticmethod
    def _named(rest: str) -> list[ParsedToolCall]:
        calls = []
        for part in rest.split("[TOOL_CALLS]"):
            name, sep, args = part.partition("[ARGS]")
            if not sep:
                name, brace, args = part.partition("{")
                args = brace + args
            try:
                obj = json.loads(args)
            except json.JSONDecodeError:
                return []
            if not is_name(name.strip()):
                return []
            calls.append(ParsedToolCall(name.strip(), json.dumps(obj)))
        return calls

    def prefill(self, name: str | None) -> str:
        if name is None:
            return '[TOOL_CALLS][{"name": "'
        return '[TOOL_CALLS][{"name": ' + json.dumps(name) + ', "arguments": '

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
