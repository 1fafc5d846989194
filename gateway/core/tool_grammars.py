"""Forced tool calls held to the tools' schemas: the grammar that continues a parser's prefill.

Under `tool_choice: required` or a named tool, the tool-call parser's prefill starts the reply
(the call's opening markup and, for a named tool, its name). The rest is sampled under a grammar
in llguidance's Lark dialect (`SamplingParams.grammar`, held by every engine with llguidance,
`engines.grammar`): the tool's name among the declared ones, its arguments as JSON valid against
that tool's `parameters`, and the family's closing markup, then the end of the reply (or, where
parallel calls are allowed and the format has a separator, more calls). So the parser always
finds the call, and the agent always gets arguments it can call its function with.

The arguments are written as the chat template's `tojson` writes JSON (`", "` and `": "`, no other
whitespace): the reply rendered back into the next turn's history is then the same text, so the
segment continues token for token. Each tool's schema is embedded whole (`%json{...}`, one rule
per tool), so its own `$ref`s resolve as the client wrote them.

A family whose format writes argument values as bare text (qwen3_coder's `<parameter=P>`) has
no grammar: the prefill forces the call, the values are free, as before.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

ARGUMENTS_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""How the arguments' JSON is spaced: as `json.dumps`, and the templates' `tojson`, write it."""


Marks = Mapping[str, int]
"""The tokenizer's added tokens (text -> id): markup such as `</tool_call>` that the chat
template's text tokenizes to one token."""


def literal(text: str, marks: Marks) -> str:
    """`text` as Lark: string literals (llguidance reads JSON's escapes), and each added token
    in it as that token (`<[id]>`), which is how the template's text tokenizes and how a
    trained model writes it (llguidance would otherwise refuse the token for its text)."""
    found = sorted(marks, key=len, reverse=True)
    pieces: list[str] = []
    rest = text
    while rest:
        hits = [(rest.find(m), m) for m in found if m and m in rest]
        if not hits:
            pieces.append(json.dumps(rest))
            break
        at, mark = min(hits, key=lambda h: (h[0], -len(h[1])))
        if at:
            pieces.append(json.dumps(rest[:at]))
        pieces.append(f"<[{marks[mark]}]>")
        rest = rest[at + len(mark) :]
    return " ".join(pieces) or '""'


def parameters(tool: dict[str, Any]) -> dict[str, Any]:
    """A function tool's argument schema; no `parameters` is any JSON object."""
    params = tool["function"].get("parameters")
    return params if isinstance(params, dict) else {"type": "object"}


def tool_names(tools: Sequence[dict[str, Any]]) -> list[str]:
    return [str(t["function"]["name"]) for t in tools]


def arguments_rule(rule: str, tool: dict[str, Any]) -> str:
    """`rule: %json{...}`: the arguments of `tool`, held to its schema."""
    return f"{rule}: %json" + json.dumps({**parameters(tool), "x-guidance": ARGUMENTS_STYLE})


def named(tools: Sequence[dict[str, Any]], name: str) -> list[str]:
    """The rule `args`: the arguments of the tool `name` (ValueError when none is declared)."""
    for tool in tools:
        if tool["function"]["name"] == name:
            return [arguments_rule("args", tool)]
    raise ValueError(f"tool {name!r} is not among the request's tools")


def any_call(
    tools: Sequence[dict[str, Any]], before: str, after: str, marks: Marks, rule: str = "call"
) -> str:
    """The rule `rule`: one call of any declared tool, as the literal `before` (where `{name}`
    stands for the tool's name, JSON-escaped, without quotes), the tool's arguments (rule `argsI`
    of `arguments_rules`), then the literal `after`."""
    parts = []
    for i, name in enumerate(tool_names(tools)):
        text = before.replace("{name}", json.dumps(name)[1:-1])
        parts.append(f"{literal(text, marks)} args{i} {literal(after, marks)}")
    return f"{rule}: " + " | ".join(parts)


def arguments_rules(tools: Sequence[dict[str, Any]]) -> list[str]:
    """`argsI`: the arguments of the I-th tool, held to its schema."""
    return [arguments_rule(f"args{i}", tool) for i, tool in enumerate(tools)]


def grammar(start: str, rules: Sequence[str]) -> str:
    """The Lark text of `start: ...` and its `rules`."""
    return "\n".join([f"start: {start}", *rules]) + "\n"
