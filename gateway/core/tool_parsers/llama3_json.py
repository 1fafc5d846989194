"""llama3_json (Llama 3.1/3.2): the whole reply, after an optional `<|python_tag|>`, is
`{"name": ..., "parameters": {...}}`, or several joined by `;`."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from gateway.core import tool_grammars as tg
from gateway.core.tool_grammars import Marks, literal
from gateway.core.tool_parsers.base import DECODER, CallIds, Parsed, first_marker, json_call


class Llama3JsonParser:
    """The reply is a call only when all of it is: a leading tag, JSON objects joined by `;`.
    `{"name"` is a marker so that a streamed reply holds back text that may turn out to be a call
    (and any `{` at a chunk's end until the next one shows it is not); other spacing such as
    `{ "name"` is no call, as no marker starts it."""

    name = "llama3_json"
    call_ids: CallIds = "call"
    json_arguments = True
    markers: tuple[str, ...] = ("<|python_tag|>", '{"name"')
    call_end: str | None = None  # a call ends where its JSON does: no text marks it
    markup: tuple[str, ...] = ("<|python_tag|>",)

    def parse(self, text: str, tools: Sequence[dict[str, Any]] = ()) -> Parsed:
        if first_marker(text, self.markers) < 0:
            return text, []
        body = text.strip().removeprefix("<|python_tag|>").strip()
        calls, pos = [], 0
        while True:
            try:
                obj, pos = DECODER.raw_decode(body, pos)
            except json.JSONDecodeError:
                return text, []
            call = json_call(obj)
            if call is None:
                return text, []
            calls.append(call)
            tail = body[pos:].lstrip()
            if not tail:
                return None, calls
            if not tail.startswith(";"):
                return text, []
            pos = len(body) - len(tail[1:].lstrip())

    def prefill(self, name: str | None) -> str:
        if name is None:
            return '{"name": "'
        return '{"name": ' + json.dumps(name) + ', "parameters": '

    def grammar(
        self, tools: Sequence[dict[str, Any]], name: str | None, parallel: bool, marks: Marks
    ) -> str:
        # one call: Llama 3.1/3.2 call one tool per reply
        if name is not None:
            return tg.grammar(f"args {literal('}', marks)}", tg.named(tools, name))
        call = tg.any_call(tools, '{name}", "parameters": ', "}", marks)
        return tg.grammar("call", [call, *tg.arguments_rules(tools)])
