"""glm45 (GLM-4.5, GLM-4.6): `<tool_call>NAME\\n`, then per argument
`<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n`, then `</tool_call>`; calls joined by `\\n`,
text before the first. The template writes a string value as its bare text and any other as JSON,
so a value is read back by its parameter's declared type (`typed_value`). A forced call is held
by the tool's properties (`tool_grammars.keyed_arguments`)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from gateway.core import tool_grammars as tg
from gateway.core.tool_grammars import KeyedStyle, Marks, literal
from gateway.core.tool_parsers.base import (
    CallIds,
    Parsed,
    ParsedToolCall,
    first_marker,
    is_name,
    parameter_type,
    typed_value,
    with_calls,
)

_BLOCK_RE = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)
_PAIR_RE = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)(?:</arg_value>|$)", re.S)


STYLE = KeyedStyle("<arg_key>", "</arg_key>\n<arg_value>", "</arg_value>\n")
"""One argument as the format writes it (`tool_grammars.keyed_arguments`)."""


class Glm45Parser:
    """GLM's key/value calls. Text between calls is dropped (the template writes only `\\n`); a
    call whose body holds anything but key/value pairs, or whose name is not a bare name, makes
    the reply text. A last call cut before its closing tags (max_tokens, a stop) is still read."""

    name = "glm45"
    call_ids: CallIds = "call"
    json_arguments = False
    markers: tuple[str, ...] = ("<tool_call>",)
    call_end: str | None = "</tool_call>"
    markup: tuple[str, ...] = (
        "<tool_call>",
        "</tool_call>",
        "<arg_key>",
        "</arg_key>",
        "<arg_value>",
        "</arg_value>",
    )

    def parse(self, text: str, tools: Sequence[dict[str, Any]] = ()) -> Parsed:
        start = first_marker(text, self.markers)
        if start < 0:
            return text, []
        calls = []
        for body in _BLOCK_RE.findall(text[start:]):
            name, _, rest = body.partition("\n")
            name = name.strip()
            if not is_name(name) or _PAIR_RE.sub("", rest).strip():
                return text, []
            args = {
                key.strip(): typed_value(value, parameter_type(tools, name, key.strip()))
                for key, value in _PAIR_RE.findall(rest)
            }
            calls.append(ParsedToolCall(name, json.dumps(args)))
        return with_calls(text[:start], calls)

    def prefill(self, name: str | None) -> str:
        return "<tool_call>" if name is None else f"<tool_call>{name}\n"

    def grammar(
        self, tools: Sequence[dict[str, Any]], name: str | None, parallel: bool, marks: Marks
    ) -> str:
        if name is not None:
            args = tg.keyed_named(tools, name, STYLE, marks)
            return tg.grammar(f"args {literal('</tool_call>', marks)}", args)
        call = tg.any_call(tools, "{name}\n", "</tool_call>", marks)
        more = f" ({literal(chr(10) + '<tool_call>', marks)} call)*" if parallel else ""
        return tg.grammar(f"call{more}", [call, *tg.keyed_rules(tools, STYLE, marks)])
