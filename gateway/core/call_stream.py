"""A forced call's arguments as they are sampled: what a stream may show of them before the reply
ends.

A reply's calls are read when it ends (`tool_parsers`: a malformed call makes the whole reply
text, which only the end decides), so under `tool_choice: auto` a call streams whole in the last
chunk. A forced call (`required`, or a tool by name) is held by its grammar (`tool_grammars`): it
cannot be malformed, and in the formats whose arguments are a JSON object after the name
(`ToolCallParser.json_arguments`) the reply starts as the parser's prefill for that tool's name,
then the object. So the first call's name is known as soon as the reply matches one tool's named
prefill, and its arguments stream as they come (`first_call_so_far`); later calls of a parallel
reply come whole at its end. A stream reads the reply once: `CallScanner` keeps its place between
chunks (`arguments_so_far` and `first_call_so_far` are the same reading, whole, for reference).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class _Braces:
    """Where a JSON object ends, read as far as its text is written and taken up again where the
    last reading stopped: braces inside strings and escaped quotes are read as JSON reads them."""

    def __init__(self) -> None:
        self.depth, self.in_string, self.escaped = 0, False, False

    def read(self, text: str, at: int) -> int:
        """Read `text[at:]` (the object starts at or before `at`): the index past its closing
        brace, or -1 while it is still open."""
        depth, in_string, escaped = self.depth, self.in_string, self.escaped
        end = -1
        for i in range(at, len(text)):
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
                    end = i + 1
                    break
        self.depth, self.in_string, self.escaped = depth, in_string, escaped
        return end


def arguments_so_far(text: str) -> tuple[str, bool]:
    """The JSON object that starts at `text`'s first `{`, as far as it is written, and whether it
    is whole (its closing brace written; what follows, the format's closing markup, is not part of
    it). Braces inside strings and escaped quotes are read as JSON reads them."""
    start = text.find("{")
    if start < 0:
        return "", False
    end = _Braces().read(text, start)
    return (text[start:end], True) if end >= 0 else (text[start:], False)


def first_call_so_far(
    text: str, names: Sequence[str], prefill: Callable[[str], str]
) -> tuple[str, str] | None:
    """(name, arguments so far) of the reply's first call, `text` the reply from its start (the
    forced prefill included), `names` the tools it may call, `prefill(name)` how a call of
    `name` starts; None while no tool's start is written whole. A stream keeps one `CallScanner`
    instead, which reads what each chunk adds only."""
    return CallScanner(names, prefill).scan(text)


class CallScanner:
    """`first_call_so_far` for a reply that grows by appending (a stream's chunks): each `scan`
    reads only what was appended since the last, so a long call costs its length once, not once
    per chunk. A text that does not extend the last one starts the reading over."""

    def __init__(self, names: Sequence[str], prefill: Callable[[str], str]) -> None:
        self._names = names
        self._prefill = prefill
        self._restart()

    def _restart(self) -> None:
        self._seen = ""
        self.name: str | None = None
        self._start = -1  # where the object starts (its `{`), once written
        self._end = -1  # where it ends (past its `}`), once written
        self._at = 0  # the next character to read
        self._braces = _Braces()

    def scan(self, text: str) -> tuple[str, str] | None:
        """(name, arguments so far) of `text`'s first call, as `first_call_so_far` reads it."""
        if not text.startswith(self._seen):
            self._restart()
        self._seen = text
        if self.name is None:
            for name in self._names:
                start = self._prefill(name)
                if text.startswith(start):
                    self.name, self._at = name, len(start)
                    break
            else:
                return None
        if self._start < 0:
            self._start = text.find("{", self._at)
            if self._start < 0:
                self._at = len(text)
                return self.name, ""
            self._at = self._start
        if self._end < 0:
            self._end = self._braces.read(text, self._at)
            self._at = len(text)
        return self.name, text[self._start : self._end if self._end >= 0 else len(text)]
