"""minimax_m2 (MiniMax-M2): one `<minimax:tool_call>\\n ... </minimax:tool_call>` block holds every
call, each `<invoke name="NAME">\\n`, then `<parameter name="K">V</parameter>\\n` per argument,
then `</invoke>\\n`; text before the block. As GLM's, the template writes a string value bare and
any other as JSON, so a value is read back by its parameter's declared type (`typed_value`). A
forced call is held by the tool's properties (`tool_grammars.keyed_arguments`)."""

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

_BLOCK_RE = re.compile(r"<minimax:tool_call>(.*?)(?:</minimax:tool_call>|$)", re.S)
_INVOKE_RE = re.compile(r'<invoke name="([^"\n]*)">(.*?)(?:</invoke>|$)', re.S)
_PARAMETER_RE = re.compile(r'<parameter name="([^"\n]*)">(.*?)(?:</parameter>|$)', re.S)


INVOKE = '<invoke name="'
END = "</invoke>\n</minimax:tool_call>"
STYLE = KeyedStyle('<parameter name="', '">', "</parameter>\n")
"""One argument as the format writes it (`tool_grammars.keyed_arguments`)."""


class MinimaxM2Parser:
    """MiniMax-M2's XML calls. A block holding anything but invokes, or an invoke holding
    anything but parameters, makes the reply text; a last call cut before its closing tags (max
    tokens, a stop) is still read. One block holds every call, so there is no text that ends one
    call alone (`call_end`)."""

    name = "minimax_m2"
    call_ids: CallIds = "call"
    json_arguments = False
    markers: tuple[str, ...] = ("<minimax:tool_call>",)
    call_end: str | None = None
    markup: tuple[str, ...] = (
        "<minimax:tool_call>",
        "</minimax:tool_call>",
        "</invoke>",
        "</parameter>",
    )

    def parse(self, text: str, tools: Sequence[dict[str, Any]] = ()) -> Parsed:
        start = first_marker(text, self.markers)
        if start < 0:
            return text, []
        calls = []
        for block in _BLOCK_RE.findall(text[start:]):
            if _INVOKE_RE.sub("", block).strip():
                return text, []
            for name, body in _INVOKE_RE.findall(block):
                if not is_name(name) or _PARAMETER_RE.sub("", body).strip():
                    return text, []
                args = {
                    key: typed_value(value, parameter_type(tools, name, key))
                    for key, value in _PARAMETER_RE.findall(body)
                }
                calls.append(ParsedToolCall(name, json.dumps(args)))
        if not calls:
            return text, []
        return with_calls(text[:start], calls)

    def prefill(self, name: str | None) -> str:
        opened = "<minimax:tool_call>\n<invoke name="
        return opened + '"' if name is None else f'{opened}"{name}">\n'

    def grammar(
        self, tools: Sequence[dict[str, Any]], name: str | None, parallel: bool, marks: Marks
    ) -> str:
        if name is not None:
            args = tg.keyed_named(tools, name, STYLE, marks)
            return tg.grammar(f"args {literal(END, marks)}", args)
        call = tg.any_call(tools, '{name}">\n', "</invoke>\n", marks)
        more = f" ({literal(INVOKE, marks)} call)*" if parallel else ""
        close = literal("</minimax:tool_call>", marks)
        return tg.grammar(f"call{more} {close}", [call, *tg.keyed_rules(tools, STYLE, marks)])
