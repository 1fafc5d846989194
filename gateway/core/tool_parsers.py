"""Tool calls out of generated text, one parser per model family's format (vLLM's names).

Each model family writes tool calls in its own markup; a parser turns a finished reply into
(content, calls) and says how the reply must start when a tool call is forced. The formats:

- `hermes` (Qwen2.5, Hermes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.
- `qwen3_coder`: `<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n`, then
  `</function>\\n</tool_call>`; values are text, read back as JSON when they parse as JSON.
- `llama3_json` (Llama 3.1/3.2): the whole reply, after an optional `<|python_tag|>`, is
  `{"name": ..., "parameters": {...}}`, or several joined by `;`.
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (v3), or
  `[TOOL_CALLS]NAME[ARGS]{...}` repeated (v11 and later).

Markers: every call starts with one of the parser's `markers`, and text with none is content. That
is what lets a stream show text as it comes without ever showing markup: the streamer cuts visible
text at the first marker and holds back a tail that could be the start of one, and the full parse
at the end decides what the held text was.

Malformed calls stay text: a call that does not parse (bad JSON, no name, ...) makes the whole reply
content with no calls. A reply is recorded for training exactly as the model wrote it, and the agent
sees what the model said rather than a call half-invented by a lenient parser (where vLLM would
return a malformed call, here it is text).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.core import tool_grammars as tg
from gateway.core.tool_grammars import Marks, literal


@dataclass(frozen=True, slots=True)
class ParsedToolCall:
    name: str
    arguments: str
    """The arguments as a JSON string, as OpenAI returns them."""


Parsed = tuple[str | None, list[ParsedToolCall]]


class ToolCallParser(Protocol):
    name: str
    markers: tuple[str, ...]
    """Texts that may start a tool call. While a reply streams, visible text is cut at the first
    marker and a partial marker at the end is held back (so markup is never streamed as text)."""
    call_end: str | None
    """The text that ends one call, where the format has one: a turn that may make one call
    only (`parallel_tool_calls: false`) stops there, so no second call is ever sampled."""

    def parse(self, text: str) -> Parsed:
        """(content outside the calls, stripped, None when empty; the calls). A malformed call
        (bad JSON, no name, ...) makes the WHOLE text content with no calls, so nothing the model
        wrote is lost; text with no marker is all content. Without calls the content is `text`
        itself, unstripped."""

    def prefill(self, name: str | None) -> str:
        """The text forced at the start of the reply when a tool must be called (name None: any
        tool, `tool_choice: required`; else that tool). Parsing prefill + generated text must give
        the call."""

    def grammar(
        self, tools: Sequence[dict[str, Any]], name: str | None, parallel: bool, marks: Marks
    ) -> str | None:
        """The grammar that continues `prefill(name)` (`gateway.core.tool_grammars`): the call's
        arguments held to its tool's schema and the format's closing markup (`marks`: the
        tokenizer's added tokens), then the end (more calls when `parallel` and the format
        separates them). None: the format cannot be held (its values are bare text), and only
        the prefill forces the call."""


def _first_marker(text: str, markers: tuple[str, ...]) -> int:
    found = [i for i in (text.find(m) for m in markers) if i >= 0]
    return min(found, default=-1)


def _with_calls(content: str, calls: list[ParsedToolCall]) -> Parsed:
    return (content.strip() or None), calls


def _json_call(obj: Any) -> ParsedToolCall | None:
    """`{"name": str, "arguments" or "parameters": object or JSON string}`, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ParsedToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args))


def _is_name(name: str) -> bool:
    """A function name written as bare text: no whitespace, quotes, braces or angle brackets
    (so template residue like `{{ tc.name }}` is not a call)."""
    return bool(name) and not any(c in "{}<>[]\"' \t\r\n" for c in name)


_HERMES_BLOCK_RE = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


class HermesParser:
    """`gateway.core.chat_render.parse_tool_calls`'s behaviour: text between or after the blocks is
    dropped, and a last block may lack its closing tag (a reply cut by max_tokens or a stop)."""

    name = "hermes"
    markers: tuple[str, ...] = ("<tool_call>",)
    call_end: str | None = "</tool_call>"

    def parse(self, text: str) -> Parsed:
        start = _first_marker(text, self.markers)
        if start < 0:
            return text, []
        calls = []
        for body in _HERMES_BLOCK_RE.findall(text[start:]):
            try:
                call = _json_call(json.loads(body))
            except json.JSONDecodeError:
                return text, []
            if call is None:
                return text, []
            calls.append(call)
        return _with_calls(text[:start], calls)

    def prefill(self, name: str | None) -> str:
        if name is None:
            return "<tool_call>\n"
        return '<tool_call>\n{"name": ' + json.dumps(name) + ', "arguments": '

    def grammar(
        self, tools: Sequence[dict[str, Any]], name: str | None, parallel: bool, marks: Marks
    ) -> str:
        end = literal("\n</tool_call>", marks)
        if name is not None:
            return tg.grammar(f"args {literal('}', marks)} {end}", tg.named(tools, name))
        again = literal("\n<tool_call>\n", marks)
        more = f" ({again} call {end})*" if parallel else ""
        call = tg.any_call(tools, '{"name": "{name}", "arguments": ', "}", marks)
        return tg.grammar(f"call {end}{more}", [call, *tg.arguments_rules(tools)])


_QWEN3_BLOCK_RE = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)
_QWEN3_FUNCTION_RE = re.compile(r"<function=([^>\n]*)>(.*?)(?:</function>|$)", re.S)
_QWEN3_PARAMETER_RE = re.compile(
    r"<parameter=([^>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S
)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _parameter_value(raw: str) -> Any:
    """One newline each side is the format's own; the rest is the value, read as JSON (numbers,
    booleans, null, arrays, objects) when it parses, else kept as the string."""
    raw = raw.removeprefix("\n").removesuffix("\n")
    try:
        return json.loads(raw.strip(), parse_constant=_reject_constant)
    except ValueError:
        return raw


class Qwen3CoderParser:
    """Qwen3-Coder's XML calls. Like vLLM, a call without its `<tool_call>` wrapper, or missing
    its closing tags at the very end, is still read."""

    name = "qwen3_coder"
    markers: tuple[str, ...] = ("<tool_call>", "<function=")
    call_end: str | None = "</tool_call>"

    def parse(self, text: str) -> Parsed:
        start = _first_marker(text, self.markers)
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
                if not _is_name(name) or not all(_is_name(p) for p, _ in params):
                    return text, []
                args = {p: _parameter_value(v) for p, v in params}
                calls.append(ParsedToolCall(name, json.dumps(args)))
        return _with_calls(text[:start], calls)

    def prefill(self, name: str | None) -> str:
        return "<tool_call>\n<function=" if name is None else f"<tool_call>\n<function={name}>\n"

    def grammar(
        self, tools: Sequence[dict[str, Any]], name: str | None, parallel: bool, marks: Marks
    ) -> None:
        return None  # parameter values are bare text: only the prefill forces the call


_DECODER = json.JSONDecoder()


class Llama3JsonParser:
    """The reply is a call only when all of it is: a leading tag, JSON objects joined by `;`.
    `{"name"` is a marker so that a streamed reply holds back text that may turn out to be a call
    (and any `{` at a chunk's end until the next one shows it is not); other spacing such as
    `{ "name"` is no call, as no marker starts it."""

    name = "llama3_json"
    markers: tuple[str, ...] = ("<|python_tag|>", '{"name"')
    call_end: str | None = None  # a call ends where its JSON does: no text marks it

    def parse(self, text: str) -> Parsed:
        if _first_marker(text, self.markers) < 0:
            return text, []
        body = text.strip().removeprefix("<|python_tag|>").strip()
        calls, pos = [], 0
        while True:
            try:
                obj, pos = _DECODER.raw_decode(body, pos)
            except json.JSONDecodeError:
                return text, []
            call = _json_call(obj)
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


class MistralParser:
    """Both forms after the first `[TOOL_CALLS]`: a JSON array (text after it is dropped, as vLLM
    does), or `NAME[ARGS]{...}` per `[TOOL_CALLS]` (or `NAME{...}` when the tokenizer decoded
    `[ARGS]` away)."""

    name = "mistral"
    markers: tuple[str, ...] = ("[TOOL_CALLS]",)
    call_end: str | None = None  # one array holds every call

    def parse(self, text: str) -> Parsed:
        start = _first_marker(text, self.markers)
        if start < 0:
            return text, []
        rest = text[start + len(self.markers[0]) :].lstrip()
        calls = self._array(rest) if rest.startswith("[") else self._named(rest)
        return _with_calls(text[:start], calls) if calls else (text, [])

    @staticmethod
    def _array(rest: str) -> list[ParsedToolCall]:
        try:
            items, _ = _DECODER.raw_decode(rest)
        except json.JSONDecodeError:
            return []
        calls = []
        for item in items if isinstance(items, list) else []:
            call = _json_call(item)
            if call is None:
                return []
            calls.append(call)
        return calls

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
            if not _is_name(name.strip()):
                return []
            calls.append(ParsedToolCall(name.strip(), json.dumps(obj)))
        return calls

    def prefill(self, name: str | None) -> str:
        if name is None:
            return '[TOOL_CALLS][{"name": "'
        return '[TOOL_CALLS][{"name": ' + json.dumps(name) + ', "arguments": '

    def grammar(
        self, tools: Sequence[dict[str, Any]], name: str | None, parallel: bool, marks: Marks
    ) -> str:
        if name is not None:
            return tg.grammar(f"args {literal('}]', marks)}", tg.named(tools, name))
        # the first call's name is inside the prefill's string; the next ones are whole objects
        first = tg.any_call(tools, '{name}", "arguments": ', "}", marks, rule="first")
        more = tg.any_call(tools, ', {"name": "{name}", "arguments": ', "}", marks)
        start = f"first{' call*' if parallel else ''} {literal(']', marks)}"
        return tg.grammar(start, [first, more, *tg.arguments_rules(tools)])


class NoToolParser:
    """The chat template writes tool calls in no format a parser here knows (auto detection found
    none): a request whose calls would be read is refused with a 400 that names `--tool-parser`
    (`gateway.core.turn.TurnCore`), rather than read by a guess; without tools, or with
    `tool_choice: none`, nothing is parsed and replies are text."""

    name = "unknown"
    markers: tuple[str, ...] = ()
    call_end: str | None = None

    def parse(self, text: str) -> Parsed:
        return text, []

    def prefill(self, name: str | None) -> str:
        raise AssertionError("a tool call is never forced without a parser")

    def grammar(
        self, tools: Sequence[dict[str, Any]], name: str | None, parallel: bool, marks: Marks
    ) -> None:
        return None


TOOL_PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser,
    "qwen3_coder": Qwen3CoderParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}

# Llama 3.1/3.2's instruction: `{"name": function name, "parameters": dictionary of ...}`.
_LLAMA3_INSTRUCTION_RE = re.compile(r'\{"name":[^{}]*"parameters"')


def detect_tool_parser(chat_template: str) -> str | None:
    """The parser a chat template's own tool-call format calls for: qwen3_coder when it writes
    `<function=`, hermes for `<tool_call>`, mistral for `[TOOL_CALLS]`, llama3_json for
    `<|python_tag|>` or a Llama-3 style `"parameters"` JSON instruction; None when nothing
    matches (never a guess: a format read by the wrong parser is silently plain text)."""
    if "<function=" in chat_template:
        return "qwen3_coder"
    if "<arg_key>" in chat_template:
        return None  # GLM-4.5+: `<tool_call>NAME<arg_key>...`, which hermes would read as text
    if "<tool_call>" in chat_template:
        return "hermes"
    if "[TOOL_CALLS]" in chat_template:
        return "mistral"
    if "<|python_tag|>" in chat_template or _LLAMA3_INSTRUCTION_RE.search(chat_template):
        return "llama3_json"
    return None


def build_tool_parser(name: str, chat_template: str) -> ToolCallParser:
    """`name` "auto": detected from the template (`NoToolParser` when nothing matches); else the
    registry's entry (ValueError naming the known parsers for an unknown name)."""
    if name == "auto":
        detected = detect_tool_parser(chat_template)
        if detected is None:
            return NoToolParser()
        name = detected
    if name not in TOOL_PARSERS:
        known = ", ".join(["auto", *TOOL_PARSERS])
        raise ValueError(f"unknown tool parser {name!r}: use one of {known}")
    return TOOL_PARSERS[name]()
