"""Tool calls out of generated text, one parser per model family's format (vLLM's names), one
module per family; this module is the registry and the detection from a chat template.

Each model family writes tool calls in its own markup; a parser turns a finished reply into
(content, calls) and says how the reply must start when a tool call is forced. The formats:

- `hermes` (Qwen2.5, Hermes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.
- `qwen3_coder`: `<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n`, then
  `</function>\\n</tool_call>`; values are text, read back as JSON when they parse as JSON.
- `llama3_json` (Llama 3.1/3.2): the whole reply, after an optional `<|python_tag|>`, is
  `{"name": ..., "parameters": {...}}`, or several joined by `;`.
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (v3), or
  `[TOOL_CALLS]NAME[ARGS]{...}` repeated (v11 and later).
- `glm45` (GLM-4.5, GLM-4.6): `<tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n`
  ... `</tool_call>`; string values bare, others JSON, read back by the declared type.
- `granite` (Granite 3.x): `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]`, nothing after.
- `phi4_mini_json` (Phi-4-mini): `functools[{"name": ..., "arguments": {...}}, ...]` after any text.
- `llama4_pythonic` (Llama 4): the whole reply is `[name(key=literal, ...), ...]`, Python literals.
- `deepseek_v31` (DeepSeek-V3.1): `<|tool_calls_begin|>`, then per call
  `<|tool_call_begin|>NAME<|tool_sep|>{...}<|tool_call_end|>`, then `<|tool_calls_end|>` (each `|`
  written as U+FF5C and `_` as U+2581).
- `kimi_k2` (Kimi-K2): `<|tool_calls_section_begin|>`, then per call
  `<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}<|tool_call_end|>`, then
  `<|tool_calls_section_end|>`; `functions.NAME:IDX` is the call's id, returned as the model wrote
  it (its template writes ids back and heads results with them).
- `openai` (gpt-oss, harmony): a commentary message to `functions.NAME`, its JSON arguments,
  `<|call|>`: `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`,
  one call a reply (`gateway.core.harmony` reads the messages).
- `minimax_m2`: `<minimax:tool_call>\n<invoke name="NAME">\n<parameter name="K">V</parameter>\n`
  ... `</invoke>\n</minimax:tool_call>`, one block for every call; values as GLM's.

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

import re

from gateway.core import harmony
from gateway.core.tool_parsers import deepseek_v31, kimi_k2
from gateway.core.tool_parsers.base import (
    NoToolParser,
    Parsed,
    ParsedToolCall,
    ToolCallParser,
)
from gateway.core.tool_parsers.deepseek_v31 import DeepseekV31Parser
from gateway.core.tool_parsers.glm45 import Glm45Parser
from gateway.core.tool_parsers.hermes import HermesParser
from gateway.core.tool_parsers.json_list import GraniteParser, Phi4MiniJsonParser
from gateway.core.tool_parsers.kimi_k2 import KimiK2Parser
from gateway.core.tool_parsers.llama3_json import Llama3JsonParser
from gateway.core.tool_parsers.llama4_pythonic import Llama4PythonicParser
from gateway.core.tool_parsers.minimax_m2 import MinimaxM2Parser
from gateway.core.tool_parsers.mistral import MistralParser
from gateway.core.tool_parsers.openai import OpenAIParser
from gateway.core.tool_parsers.qwen3_coder import Qwen3CoderParser

__all__ = [
    "TOOL_PARSERS",
    "DeepseekV31Parser",
    "Glm45Parser",
    "GraniteParser",
    "HermesParser",
    "KimiK2Parser",
    "Llama3JsonParser",
    "Llama4PythonicParser",
    "MinimaxM2Parser",
    "MistralParser",
    "NoToolParser",
    "OpenAIParser",
    "Parsed",
    "ParsedToolCall",
    "Phi4MiniJsonParser",
    "Qwen3CoderParser",
    "ToolCallParser",
    "build_tool_parser",
    "detect_tool_parser",
]

TOOL_PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser,
    "qwen3_coder": Qwen3CoderParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "glm45": Glm45Parser,
    "minimax_m2": MinimaxM2Parser,
    "granite": GraniteParser,
    "phi4_mini_json": Phi4MiniJsonParser,
    "llama4_pythonic": Llama4PythonicParser,
    "deepseek_v31": DeepseekV31Parser,
    "kimi_k2": KimiK2Parser,
    "openai": OpenAIParser,
}

# Llama 3.1/3.2's instruction: `{"name": function name, "parameters": dictionary of ...}`.
_LLAMA3_INSTRUCTION_RE = re.compile(r'\{"name":[^{}]*"parameters"')


def detect_tool_parser(chat_template: str) -> str | None:
    """The parser a chat template's own tool-call format calls for: openai for harmony's
    `<|channel|>`, minimax_m2 when it writes
    `<minimax:tool_call>`, granite for its `available_tools` role, phi4_mini_json for `functools[`,
    llama4_pythonic for its `[func_name1(` instruction, deepseek_v31 for its calls marker
    without V3's fenced JSON, kimi_k2 for its calls section,
    qwen3_coder for `<function=`, glm45 for `<arg_key>`, hermes for
    `<tool_call>`, mistral for `[TOOL_CALLS]`, llama3_json for `<|python_tag|>` or a Llama-3 style
    `"parameters"` JSON instruction; None when nothing matches (never a guess: a format read by the
    wrong parser is silently plain text)."""
    if harmony.CHANNEL in chat_template:
        return "openai"
    if "<minimax:tool_call>" in chat_template:
        return "minimax_m2"
    if "<|start_of_role|>available_tools" in chat_template:
        return "granite"
    if "functools[" in chat_template:
        return "phi4_mini_json"
    if "[func_name1(" in chat_template:
        return "llama4_pythonic"
    if deepseek_v31.CALLS_BEGIN in chat_template:
        # V3.1's bare `NAME<sep>{...}`; V3-0324's fenced JSON is another format
        return None if "```json" in chat_template else "deepseek_v31"
    if kimi_k2.SECTION_BEGIN in chat_template:
        return "kimi_k2"
    if "<function=" in chat_template:
        return "qwen3_coder"
    if "<arg_key>" in chat_template:
        return "glm45"  # before hermes: GLM's calls open with `<tool_call>` too
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
