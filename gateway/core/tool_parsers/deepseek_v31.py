"""deepseek_v31 (DeepSeek-V3.1): after the content, `<|tool_calls_begin|>`, then per call
`<|tool_call_begin|>NAME<|tool_sep|>{JSON arguments}<|tool_call_end|>` with nothing between
calls, then `<|tool_calls_end|>`, where the model writes each `|` as U+FF5C and each `_` as
U+2581 (the constants below; each marker is one token). Its template takes the arguments back as
JSON text (`ChatRenderer.arguments_as_text`). DeepSeek-V3-0324's fenced form (`function`, the
separator, the name, then the arguments in a ```json fence) is another format, not read here."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from gateway.core import tool_grammars as tg
from gateway.core.tool_grammars import Marks, literal
from gateway.core.tool_parsers.base import (
    CallIds,
    Parsed,
    ParsedToolCall,
    first_marker,
    is_name,
    json_object,
    with_calls,
)

CALLS_BEGIN = "<\uff5ctool\u2581calls\u2581begin\uff5c>"
CALLS_END = "<\uff5ctool\u2581calls\u2581end\uff5c>"
CALL_BEGIN = "<\uff5ctool\u2581call\u2581begin\uff5c>"
CALL_END = "<\uff5ctool\u2581call\u2581end\uff5c>"
SEP = "<\uff5ctool\u2581sep\uff5c>"
_CALL_RE = re.compile(
    re.escape(CALL_BEGIN) + r"(.*?)" + re.escape(SEP) + r"(.*?)(?:" + re.escape(CALL_END) + "|$)",
    re.S,
)


class DeepseekV31Parser:
    """The calls section after the first `CALLS_BEGIN`, text before it the content and
    text after its end dropped (as vLLM reads it). A section holding anything but calls, a name
    that is not bare, or arguments that are not a JSON object make the reply text; a last call
    cut before its end marker (max_tokens, a stop) is still read."""

    name = "deepseek_v31"
    call_ids: CallIds = "call"
    json_arguments = True
    markers: tuple[str, ...] = (CALLS_BEGIN,)
    call_end: str | None = None  # the section ends after the last call
    markup: tuple[str, ...] = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)

    def parse(self, text: str, tools: Sequence[dict[str, Any]] = ()) -> Parsed:
        start = first_marker(text, self.markers)
        if start < 0:
            return text, []
        section = text[start + len(CALLS_BEGIN) :].split(CALLS_END, 1)[0]
        if _CALL_RE.sub("", section).strip():
            return text, []
        calls = []
        for name, raw in _CALL_RE.findall(section):
            args = json_object(raw)
            if args is None or not is_name(name):
                return text, []
            calls.append(ParsedToolCall(name, json.dumps(args)))
        return with_calls(text[:start], calls) if calls else (text, [])

    def prefill(self, name: str | None) -> str:
        opened = CALLS_BEGIN + CALL_BEGIN
        return opened if name is None else opened + name + SEP

    def grammar(
        self, tools: Sequence[dict[str, Any]], name: str | None, parallel: bool, marks: Marks
    ) -> str:
        end = literal(CALLS_END, marks)
        if name is not None:
            return tg.grammar(f"args {literal(CALL_END, marks)} {end}", tg.named(tools, name))
        call = tg.any_call(tools, "{name}" + SEP, CALL_END, marks)
        more = f" ({literal(CALL_BEGIN, marks)} call)*" if parallel else ""
        return tg.grammar(f"call{more} {end}", [call, *tg.arguments_rules(tools)])
