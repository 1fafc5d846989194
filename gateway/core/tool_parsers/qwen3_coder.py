"""qwen3_coder: `<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n`, then
`</function>\\n</tool_call>`; a value is read by its parameter's declared type (`typed_value`):
text for a string, else JSON when it parses. A forced call is held by the tool's properties
(`tool_grammars.keyed_arguments`)."""

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

_QWEN3_BLOCK_RE = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)
_QWEN3_FUNCTION_RE = re.compile(r"<function=([^>\n]*)>(.*?)(?:</function>|$)", re.S)
_QWEN3_PARAMETER_RE = re.compile(
    r"<parameter=([^>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S
)


STYLE = KeyedStyle("<parameter=", ">\n", "\n</parameter>\n")
"""One argument as the format writes it (`tool_grammars.keyed_arguments`)."""


class Qwen3CoderParser:
    """Qwen3-Coder's XML calls. Like vLLM, a call without its `<tool_call>` wrapper, or missing
    its closing tags at the very end, is still read."""

    name = "qwen3_coder"
    call_ids: CallIds = "call"
    json_arguments = False
    markers: tuple[str, ...] = ("<tool_call>", "<function=")
    call_end: str | None = "</tool_call>"
    markup: tuple[str, ...] = (
        "<tool_call>",
        "</tool_call>",
        "<function=",
        "</function>",
        "<parameter=",
        "</parameter>",
    )

    def parse(self, text: str, tools: Sequence[dict[str, Any]] = ()) -> Parsed:
        start = first_marker(text, self.markers)
        if start < 0:
            return text, []
        rest = text[start:]
        bodies = _QWEN3_BLOCK_RE.findall(rest) if rest.startswith("<tool_call>") else [rest]
        calls = []
        for body in bodies:
            functions = _QWEN3_FUNCTION_RE.findall(body)
            if not functions:
                return text, []
            for name, body_params in functions:
                params = _QWEN3_PARAMETER_RE.findall(body_params)
                if not is_name(name) or not all(is_name(p) for p, _ in params):
                    return text, []
                # one newline each side of a value is the format's own
                args = {
                    p: typed_value(
                        v.removeprefix("\n").removesuffix("\n"), parameter_type(tools, name, p)
                    )
                    for p, v in params
                }
                calls.append(ParsedToolCall(name, json.dumps(args)))
        return with_calls(text[:start], calls)

    def prefill(self, name: str | None) -> str:
        return "<tool_call>\n<function=" if name is None else f"<tool_call>\n<function={name}>\n"

    def grammar(
        self, tools: Sequence[dict[str, Any]], name: str | None, parallel: bool, marks: Marks
    ) -> str:
        end = "</function>\n</tool_call>"
        if name is not None:
            args = tg.keyed_named(tools, name, STYLE, marks)
            return tg.grammar(f"args {literal(end, marks)}", args)
        call = tg.any_call(tools, "{name}>\n", end, marks)
        again = literal("\n<tool_call>\n<function=", marks)
        more = f" ({again} call)*" if parallel else ""
        return tg.grammar(f"call{more}", [call, *tg.keyed_rules(tools, STYLE, marks)])
