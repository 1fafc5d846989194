"""A forced call's arguments as they are sampled: what a stream may show of them before the reply
ends.

A reply's calls are read when it ends (`tool_parsers`: a malformed call makes the whole reply
text, which only the end decides), so under `tool_choice: auto` a call streams whole in the last
chunk. A call forced by name is held by its grammar (`tool_grammars`): it cannot be malformed, its
name is the one asked for and its arguments (a JSON object in the formats that declare
`ToolCallParser.json_arguments`) are the first object the model writes after the prefill. Those
stream as they come: `arguments_so_far` reads them from the sampled text.
"""

from __future__ import annotations


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
