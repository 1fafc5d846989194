"""A forced call's arguments as they are sampled: what a stream may show of them before the reply
ends.

A reply's calls are read when it ends (`tool_parsers`: a malformed call makes the whole reply
text, which only the end decides), so under `tool_choice: auto` a call streams whole in the last
chunk. A forced call (`required`, or a tool by name) is held by its grammar (`tool_grammars`): it
cannot be malformed, and in the formats whose arguments are a JSON object after the name
(`ToolCallParser.json_arguments`) the reply starts as the parser's prefill for that tool's name,
then the object. So the first call's name is known as soon as the reply matches one tool's named
prefill, and its arguments stream as they come (`first_call_so_far`); later calls of a parallel
reply come whole at its end.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def arguments_so_far(text: str) -> tuple[str, bool]:
    """The JSON object that starts at `text`'s first `{`, as far as it is written, and whether it
    is whole (its closing brace written; what follows, the format's closing markup, is not part of
    it). Braces inside strings and escaped quotes are read as JSON reads them."""
    start = text.find("{")
    if start < 0:
        return "", False
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start : i + 1], True
    return text[start:], False


def first_call_so_far(
    text: str, names: Sequence[str], prefill: Callable[[str], str]
) -> tuple[str, str] | None:
    """(name, arguments so far) of the reply's first call, `text` the reply from its start (the
    forced prefill included), `names` the tools it may call, `prefill(name)` how a call of
    `name` starts; None while no tool's start is written whole."""
    for name in names:
        start = prefill(name)
        if text.startswith(start):
            return name, arguments_so_far(text[len(start) :])[0]
    return None
