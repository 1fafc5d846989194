"""kimi_k2 (Kimi-K2): after the content, `<|tool_calls_section_begin|>`, then per call
`<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{JSON arguments}<|tool_call_end|>`
with nothing between calls, then `<|tool_calls_section_end|>` (each marker one token).
`functions.NAME:IDX` is the call's id, IDX counting the conversation's calls: Kimi's template
writes each call's id back into the history and heads each tool result with `## Return of ID`,
so the id the model wrote is the id the client gets (`ParsedToolCall.id`), and the result it
sends back names it as the model expects. Some checkpoints write the section markers in the
singular (`<|tool_call_section_begin|>`); both are read."""

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

SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
SINGULAR_BEGIN = "<|tool_call_section_begin|>"
SINGULAR_END = "<|tool_call_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENTS = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
_CALL_RE = re.compile(
    re.escape(CALL_BEGIN)
    + r"\s*(functions\.([^\s:<>]+):(\d+))\s*"
    + re.escape(ARGUMENTS)
    + r"(.*?)(?:"
    + re.escape(CALL_END)
    + "|$)",
    re.S,
)
_SECTION_END_RE = re.compile(f"{re.escape(SECTION_END)}|{re.escape(SINGULAR_END)}")


class KimiK2Parser:
    """The section after the first section marker, text before it the content, text after its
    end dropped (as vLLM reads it). A section holding anything but calls, an id that is not
    `functions.NAME:IDX` with a bare name, or arguments that are not a JSON object make the reply
    text; a last call cut before its end marker (max_tokens, a stop, one call allowed) is still
    read."""

    name = "kimi_k2"
    call_ids: CallIds = "call"
    json_arguments = False
    markers: tuple[str, ...] = (SECTION_BEGIN, SINGULAR_BEGIN)
    call_end: str | None = CALL_END
    markup: tuple[str, ...] = (
        SECTION_BEGIN,
        SECTION_END,
        SINGULAR_BEGIN,
        SINGULAR_END,
        CALL_BEGIN,
        ARGUMENTS,
        CALL_END,
    )

    def parse(self, text: str, tools: Sequence[dict[str, Any]] = ()) -> Parsed:
        start = first_marker(text, self.markers)
        if start < 0:
            return text, []
        opener = SECTION_BEGIN if text.startswith(SECTION_BEGIN, start) else SINGULAR_BEGIN
        section = _SECTION_END_RE.split(text[start + len(opener) :], maxsplit=1)[0]
        if _CALL_RE.sub("", section).strip():
            return text, []
        calls = []
        for call_id, name, _, raw in _CALL_RE.findall(section):
            args = json_object(raw)
            if args is None or not is_name(name):
                return text, []
            calls.append(ParsedToolCall(name, json.dumps(args), call_id))
        return with_calls(text[:start], calls) if calls else (text, [])

    def prefill(self, name: str | None) -> str:
        opened = SECTION_BEGIN + CALL_BEGIN + "functions."
        return opened if name is None else f"{opened}{name}:"

    def grammar(
        self, tools: Sequence[dict[str, Any]], name: str | None, parallel: bool, marks: Marks
    ) -> str:
        """After the prefill: the call's index, its arguments, the ends (the index is the
        model's own count of the conversation's calls: `INDEX`)."""
        arguments, end = literal(ARGUMENTS, marks), literal(CALL_END, marks)
        close = literal(SECTION_END, marks)
        if name is not None:
            return tg.grammar(
                f"index {arguments} args {end} {close}", [*tg.named(tools, name), INDEX]
            )
        calls = [
            f"{literal(n + ':', marks)} index {arguments} args{i} {end}"
            for i, n in enumerate(tg.tool_names(tools))
        ]
        more = f" ({literal(CALL_BEGIN + 'functions.', marks)} call)*" if parallel else ""
        rules = ["call: " + " | ".join(calls), INDEX, *tg.arguments_rules(tools)]
        return tg.grammar(f"call{more} {close}", rules)


INDEX = "index: /0|[1-9][0-9]{0,4}/"
"""The rule of a call's index in its id: a count, 0 to 99999 (a conversation's calls fit; an
unbounded run of digits would let a forced call spend its whole budget on its id)."""
