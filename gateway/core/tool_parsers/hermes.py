"""hermes (Qwen2.5, Hermes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from gateway.core import tool_grammars as tg
from gateway.core.tool_grammars import Marks, literal
from gateway.core.tool_parsers.base import CallIds, Parsed, first_marker, json_call, with_calls

_HERMES_BLOCK_RE = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


class HermesParser:
    """`gateway.core.chat_render.parse_tool_calls`'s behaviour: text between or after the blocks is
    dropped, and a last block may lack its closing tag (a reply cut by max_tokens or a stop)."""

    name = "hermes"
    call_ids: CallIds = "call"
    json_arguments = True
    markers: tuple[str, ...] = ("<tool_call>",)
    call_end: str | None = "</tool_call>"
    markup: tuple[str, ...] = ("<tool_call>", "</tool_call>")

    def parse(self, text: str, tools: Sequence[dict[str, Any]] = ()) -> Parsed:
        start = first_marker(text, self.markers)
        if start < 0:
            return text, []
        calls = []
        for body in _HERMES_BLOCK_RE.findall(text[start:]):
            try:
                call = json_call(json.loads(body))
            except json.JSONDecodeError:
                return text, []
            if call is None:
                return text, []
            calls.append(call)
        return with_calls(text[:start], calls)

    def prefill(self, name: str | None) -> str:
        if name is None:
            return "<tool_call>\n"
        return '<tool_call>\n{"name": ' + json.dumps(name) + ', "arguments": '

    def grammar(
        self, tools: Sequence[dict[str, Any]], name: str | None, parallel: bool, marks: Marks
    ) -> str:
        end = literal("\n</tool_call>", marks)
        if name is not None:
            return tg.grammar(f"args {literal('}', marks)} {end}", tg.named(tools, name))
        again = literal("\n<tool_call>\n", marks)
        more = f" ({again} call {end})*" if parallel else ""
        call = tg.any_call(tools, '{"name": "{name}", "arguments": ', "}", marks)
        return tg.grammar(f"call {end}{more}", [call, *tg.arguments_rules(tools)])
