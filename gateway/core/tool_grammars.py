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

A family whose format writes each argument as its key and value in markup, a string value as its
bare text and any other as JSON (qwen3_coder, glm45, minimax_m2: `KeyedStyle`), is held by the
tool's declared properties (`keyed_arguments`): each in declared order, a required one always, an
optional one or not, none other; a value of a `string` property is bare text up to the format's
closing markup (as the parser reads it, the first closing markup ends it), held to the property's
`enum`, `const`, `minLength` and `maxLength` (not its `pattern` or `format`); any other value is
JSON held to the property's schema. A tool that declares no properties takes any keys, values as
bare text.

A Python-literal format (llama4_pythonic: `name(key=value, ...)`) is held the same way, by the
tool's declared properties as keyword arguments (`python_arguments`): a value of a string,
number or integer property (or an array of them, or an `enum`/`const` of them) is written as JSON
writes it, which Python reads as the same value, a string without JSON's `\\/` escape (Python
would keep its backslash); a boolean is `True`/`False` and null `None`. A tool with a property of
any other kind (an object, a boolean inside an array, no type) is not held: its call is forced by
the prefill only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
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


def resolved(schema: Any, root: Mapping[str, Any]) -> Any:
    """`schema` with its local `$ref` (`#/$defs/X`, `#/definitions/X`, against `root`) followed
    until it names no other (a cycle or a reference it cannot follow stops there)."""
    seen: set[str] = set()
    while isinstance(schema, dict) and isinstance(schema.get("$ref"), str):
        ref = schema["$ref"]
        if ref in seen or not ref.startswith("#/"):
            break
        seen.add(ref)
        node: Any = root
        for part in ref[2:].split("/"):
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            break
        schema = node
    return schema


def is_text(schema: Any) -> bool:
    """A property a keyed format writes as bare text: declared `string`, or (undeclared) a
    `const` or `enum` of strings only."""
    if not isinstance(schema, dict):
        return False
    if "type" in schema:
        return bool(schema["type"] == "string")
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    return isinstance(values, list) and bool(values) and all(isinstance(v, str) for v in values)


@dataclass(frozen=True, slots=True)
class KeyedStyle:
    """How a keyed format writes one argument: `key_open` KEY `key_close` VALUE `value_close`."""

    key_open: str
    key_close: str
    value_close: str


_REGEX_SPECIAL = frozenset("\\.+*?()|[]{}^$/")


def _regex(text: str) -> str:
    """`text` matched literally inside a Lark `/.../` regex."""
    out = []
    for c in text:
        if c in _REGEX_SPECIAL:
            out.append("\\" + c)
        elif c == "\n":
            out.append("\\n")
        elif c == "\t":
            out.append("\\t")
        elif c == "\r":
            out.append("\\r")
        else:
            out.append(c)
    return "".join(out)


def bare_text(rule: str, schema: Mapping[str, Any], close: str, marks: Marks) -> list[str]:
    """`rule`: a string value written as its bare text, then `close` (the format's markup after
    a value). Text ends at the first `close`, as the parser reads it: a lazy lexeme, or, where
    `close` holds an added token, text up to it (the token cannot be text)."""
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    if isinstance(values, list) and values:
        return [f"{rule}: " + " | ".join(literal(str(v) + close, marks) for v in values)]
    lo, hi = int(schema.get("minLength", 0)), schema.get("maxLength")
    body = (
        "(.|\\n)*" if lo == 0 and hi is None else f"(.|\\n){{{lo},{'' if hi is None else int(hi)}}}"
    )
    hits = [close.find(m) for m in marks if m and m in close]
    if not hits:
        return [f"{rule}[lazy]: /{body}{_regex(close)}/"]
    at = min(hits)
    return [f"{rule}: /{body}{_regex(close[:at])}/ {literal(close[at:], marks)}"]


def keyed_arguments(rule: str, tool: dict[str, Any], style: KeyedStyle, marks: Marks) -> list[str]:
    """`rule`: the arguments of `tool` in a keyed format (module docstring)."""
    params = parameters(tool)
    props = params.get("properties")
    value_close = literal(style.value_close, marks)
    if not isinstance(props, dict) or not props:  # any keys: each value bare text
        head = literal(style.key_open, marks)
        return [
            f"{rule}: {rule}_pair*",
            f"{rule}_pair: {head} {rule}_key {literal(style.key_close, marks)} {rule}_value",
            f'{rule}_key: /[^\\s<>"=\\/]+/',
            *bare_text(f"{rule}_value", {}, style.value_close, marks),
        ]
    defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
    required = set(params.get("required") or ())
    parts, rules = [], []
    for j, (key, prop) in enumerate(props.items()):
        pair, value = f"{rule}_{j}", f"{rule}_{j}_value"
        schema = resolved(prop, params)
        head = literal(style.key_open + str(key) + style.key_close, marks)
        if is_text(schema):
            rules += [
                f"{pair}: {head} {value}",
                *bare_text(value, schema, style.value_close, marks),
            ]
        else:
            held = {**(schema if isinstance(schema, dict) else {}), **defs}
            rules += [
                f"{pair}: {head} {value} {value_close}",
                f"{value}: %json" + json.dumps({**held, "x-guidance": ARGUMENTS_STYLE}),
            ]
        parts.append(pair if key in required else f"{pair}?")
    return [f"{rule}: " + " ".join(parts), *rules]


def keyed_named(
    tools: Sequence[dict[str, Any]], name: str, style: KeyedStyle, marks: Marks
) -> list[str]:
    """The rule `args`: the arguments of the tool `name` in a keyed format (ValueError when no
    such tool is declared)."""
    for tool in tools:
        if tool["function"]["name"] == name:
            return keyed_arguments("args", tool, style, marks)
    raise ValueError(f"tool {name!r} is not among the request's tools")


def keyed_rules(tools: Sequence[dict[str, Any]], style: KeyedStyle, marks: Marks) -> list[str]:
    """`argsI`: the arguments of the I-th tool in a keyed format (as `arguments_rules`)."""
    return [r for i, t in enumerate(tools) for r in keyed_arguments(f"args{i}", t, style, marks)]


_PYTHON_SCALARS = frozenset({"string", "number", "integer"})


def _python_safe(schema: Any, root: Mapping[str, Any]) -> bool:
    """A value JSON writes as Python reads it (no `true`, `false` or `null` inside)."""
    schema = resolved(schema, root)
    if not isinstance(schema, dict):
        return False
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    if isinstance(values, list):
        return bool(values) and all(
            isinstance(v, str | int | float) and not isinstance(v, bool) for v in values
        )
    kind = schema.get("type")
    if kind == "array":
        return _python_safe(schema.get("items"), root)
    return kind in _PYTHON_SCALARS


def _python_string(schema: Mapping[str, Any]) -> str:
    """A JSON string literal (bar `\\/`) held to `minLength`/`maxLength`, an escape one char."""
    lo, hi = int(schema.get("minLength", 0)), schema.get("maxLength")
    char = '([^"\\\\\\x00-\\x1f]|\\\\["\\\\bfnrt]|\\\\u[0-9a-fA-F]{4})'
    reps = "*" if lo == 0 and hi is None else f"{{{lo},{'' if hi is None else int(hi)}}}"
    return f'/"{char}{reps}"/'


def python_value(schema: Any, root: Mapping[str, Any]) -> str | None:
    """The Lark of one keyword argument's value (module docstring); None: it cannot be held."""
    schema = resolved(schema, root)
    if not isinstance(schema, dict):
        return None
    if schema.get("type") == "boolean":
        return '"True" | "False"'
    if schema.get("type") == "null":
        return '"None"'
    if not _python_safe(schema, root):
        return None
    if schema.get("type") == "string" and "enum" not in schema and "const" not in schema:
        return _python_string(schema)
    defs = {k: root[k] for k in ("$defs", "definitions") if k in root}
    return "%json" + json.dumps({**schema, **defs, "x-guidance": ARGUMENTS_STYLE})


def python_arguments(rule: str, tool: dict[str, Any]) -> list[str] | None:
    """`rule`: the keyword arguments of `tool` in declared order, `, `-separated, a required one
    always, an optional one or not; None when a property cannot be held (`python_value`)."""
    params = parameters(tool)
    props = params.get("properties") or {}
    if not isinstance(props, dict):
        return None
    required = set(params.get("required") or ())
    keys = list(props)
    rules = []
    for j, key in enumerate(keys):
        value = python_value(props[key], params)
        if value is None or not str(key).isidentifier():
            return None
        rules.append(f"{rule}_{j}: {json.dumps(str(key) + '=')} ({value})")

    def after(j: int) -> str:  # the arguments from j on, something written before them
        if j == len(keys):
            return ""
        pair = f'", " {rule}_{j}'
        return (f"{pair} " if keys[j] in required else f"({pair})? ") + after(j + 1)

    def first(j: int) -> str:  # the arguments from j on, nothing written before them
        if j == len(keys):
            return ""
        if keys[j] in required:
            return f"{rule}_{j} {after(j + 1)}"
        rest = first(j + 1).strip()
        return f"({rule}_{j} {after(j + 1)}| {rest})" if rest else f"({rule}_{j})?"

    body = first(0).strip()
    return [f"{rule}: {body}" if body else f'{rule}: ""', *rules]
