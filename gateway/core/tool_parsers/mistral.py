"""mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (v3), or
`[TOOL_CALLS]NAME[ARGS]{...}` repeated (v11 and later). Mistral's templates write each call's id
back into the history and refuse any id that is not nine letters and digits, so each call read
gets such an id (`ParsedToolCall.id`, as vLLM's `MistralToolCall` makes them), which the client
gets and sends back."""

from __future__ import annotations

import dataclasses
import json
import secrets
import string
from collections.abc import Sequence
from typing import Any

from gateway.core.tool_parsers.base import (
    Parsed,
    ParsedToolCall,
    first_marker,
    is_name,
    with_calls,
)
from gateway.core.tool_parsers.json_list import JsonListParser

_ID_ALPHABET = string.ascii_letters + string.digits


def mistral_id() -> str:
    """A call id as Mistral's templates take them: nine letters and digits."""
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))


class MistralParser(JsonListParser):
    """Both forms after the first `[TOOL_CALLS]`: a JSON array (text after it is dropped, as vLLM
    does), or `NAME[ARGS]{...}` per `[TOOL_CALLS]` (or `NAME{...}` when the tokenizer decoded
    `[ARGS]` away). A forced call is written in the array form."""

    name = "mistral"
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
            content, listed = super().parse(text, tools)
            return content, [dataclasses.replace(c, id=mistral_id()) for c in listed]
        calls = [dataclasses.replace(c, id=mistral_id()) for c in self._named(rest)]
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
