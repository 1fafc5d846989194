"""llama4_pythonic (Llama 4; Llama 3.2's pythonic prompt too): the whole reply is one Python list of
calls with keyword arguments, `[get_weather(city="Paris", days=3), get_time(tz="UTC")]`, maybe
inside `<|python_start|>` ... `<|python_end|>`. Values are Python literals, read with `ast` (never
evaluated)."""

from __future__ import annotations

import ast
import json
from collections.abc import Sequence
from typing import Any

from gateway.core import tool_grammars as tg
from gateway.core.tool_grammars import Marks
from gateway.core.tool_parsers.base import CallIds, Parsed, ParsedToolCall, is_name


def _calls(body: str) -> list[ParsedToolCall] | None:
    """The calls of a Python list of `name(key=literal, ...)`; None when it is anything else (a
    positional argument, an expression that is not a literal, a value JSON cannot carry)."""
    try:
        tree = ast.parse(body, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
            return None
        if not is_name(node.func.id) or any(k.arg is None for k in node.keywords):
            return None
        try:
            args = {str(k.arg): ast.literal_eval(k.value) for k in node.keywords}
            calls.append(ParsedToolCall(node.func.id, json.dumps(args)))
        except (ValueError, TypeError, SyntaxError):
            return None
    return calls


class Llama4PythonicParser:
    """A reply is calls only when all of it is the list (surrounding whitespace aside); any other
    reply, text before or after included, is content. `[` is a marker, so a streamed reply holds
    back from its first `[` until the end shows whether it was a call list."""

    name = "llama4_pythonic"
    call_ids: CallIds = "call"
    json_arguments = False
    markers: tuple[str, ...] = ("<|python_start|>", "[")
    call_end: str | None = None  # one list holds every call
    markup: tuple[str, ...] = ("<|python_start|>", "<|python_end|>")

    def parse(self, text: str, tools: Sequence[dict[str, Any]] = ()) -> Parsed:
        body = text.strip()
        if body.startswith("<|python_start|>"):
            body = body.removeprefix("<|python_start|>").replace("<|python_end|>", "").strip()
        if not body.startswith("["):
            return text, []
        calls = _calls(body)
        return (None, calls) if calls else (text, [])

    def prefill(self, name: str | None) -> str:
        return "[" if name is None else f"[{name}("

    def grammar(
        self, tools: Sequence[dict[str, Any]], name: str | None, parallel: bool, marks: Marks
    ) -> str | None:
        """The keyword arguments held by the tools' properties (`tool_grammars.python_arguments`),
        `)`, more calls where parallel ones are allowed (not after a named tool's call), `]`;
        None where a tool's property cannot
        be held (the prefill alone then forces the call)."""
        rules: list[str] = []
        calls = []
        for i, tool in enumerate(tools):
            held = tg.python_arguments(f"args{i}", tool)
            if held is None:
                return None
            rules += held
            calls.append(f'{json.dumps(tg.tool_names([tool])[0] + "(")} args{i} ")"')
        rules.append("call: " + " | ".join(calls))
        more = ' (", " call)*' if parallel else ""
        if name is None:
            return tg.grammar(f'call{more} "]"', rules)
        if name not in tg.tool_names(tools):
            raise ValueError(f"tool {name!r} is not among the request's tools")
        named = tg.tool_names(tools).index(name)
        return tg.grammar(f'args{named} ")" "]"', rules)  # a named tool: that one call
