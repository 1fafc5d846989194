"""mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (v3), or
`[TOOL_CALLS]NAME[ARGS]{...}` repeated (v11 and later). Mistral's templates write each call's id
back into the history and refuse any id that is not nine letters and digits, so its calls get
such ids (`call_ids`, as vLLM's `MistralToolCall` makes them), which the client gets and sends
back."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from gateway.core.tool_parsers.base import (
    CallIds,
    Parsed,
    ParsedToolCall,
    first_marker,
    is_name,
    with_calls,
)
from gateway.core.tool_parsers.json_list import JsonListParser


class MistralParser(JsonListParser):
    """Both forms after the first `[TOOL_CALLS]`: a JSON array (text after it is dropped, as vLLM
    does), or `NAME[ARGS]{...}` per `[TOOL_CALLS]` (or `NAME{...}` when the tokenizer decoded
    `[ARGS]` away). A forced call is written in the array form."""

    name = "mistral"
    call_ids: CallIds = "alnum9"
    opener = "[TOOL_CALLS]"
    markers: tuple[str, ...] = ("[TOOL_CALLS]",)
    markup: tuple[str, ...] = ("[TOOL_CALLS]", "[ARGS]")
    trailing = "drop"

    def parse(self, text: str, tools: Sequence[dict[str, Any]] = ()) -> Parsed:
        start = first_marker(text, self.markers)
        if start < 0:
            return text, []
        rest = text[start + len(self.opener) :].lstrip()
        if rest.startswith("["):
            return super().parse(text, tools)
        calls = self._named(rest)
        return with_calls(text[:start], calls) if calls else (text, [])

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
