"""The tool-call formats as each family's template writes them, for the parser tests: one writer
per format (calls in, the reply's text out) and the parser that reads it."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from gateway.core.tool_parsers import (
    DeepseekV31Parser,
    Glm45Parser,
    GraniteParser,
    HermesParser,
    KimiK2Parser,
    Llama3JsonParser,
    MinimaxM2Parser,
    MistralParser,
    OpenAIParser,
    Parsed,
    Phi4MiniJsonParser,
    Qwen3CoderParser,
    ToolCallParser,
)

Call = tuple[str, dict[str, Any]]


def calls_of(parsed: Parsed) -> list[Call]:
    return [(c.name, json.loads(c.arguments)) for c in parsed[1]]


def hermes(calls: list[Call]) -> str:
    return "\n".join(
        f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls
    )


def qwen3_value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def qwen3(calls: list[Call]) -> str:
    return "\n".join(
        f"<tool_call>\n<function={n}>\n"
        + "".join(f"<parameter={k}>\n{qwen3_value(v)}\n</parameter>\n" for k, v in a.items())
        + "</function>\n</tool_call>"
        for n, a in calls
    )


def glm45(calls: list[Call]) -> str:
    """As GLM-4.5's template writes calls: bare strings, JSON otherwise."""
    return "\n".join(
        f"<tool_call>{n}\n"
        + "".join(
            f"<arg_key>{k}</arg_key>\n<arg_value>{qwen3_value(v)}</arg_value>\n"
            for k, v in a.items()
        )
        + "</tool_call>"
        for n, a in calls
    )


def llama3(calls: list[Call]) -> str:
    return "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)


def mistral_v3(calls: list[Call]) -> str:
    return "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in calls])


def mistral_v11(calls: list[Call]) -> str:
    return "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in calls)


def granite(calls: list[Call]) -> str:
    return "<|tool_call|>" + json.dumps([{"name": n, "arguments": a} for n, a in calls])


def phi4_mini(calls: list[Call]) -> str:
    return "functools" + json.dumps([{"name": n, "arguments": a} for n, a in calls])


def pythonic(calls: list[Call]) -> str:
    """Python literals: repr writes them (None, True, nested lists and dicts)."""
    return (
        "["
        + ", ".join(f"{n}(" + ", ".join(f"{k}={v!r}" for k, v in a.items()) + ")" for n, a in calls)
        + "]"
    )


def deepseek_v31(calls: list[Call]) -> str:
    from gateway.core.tool_parsers import deepseek_v31 as ds

    return (
        ds.CALLS_BEGIN
        + "".join(f"{ds.CALL_BEGIN}{n}{ds.SEP}{json.dumps(a)}{ds.CALL_END}" for n, a in calls)
        + ds.CALLS_END
    )


def kimi_k2(calls: list[Call]) -> str:
    """As Kimi-K2 writes calls: ids `functions.NAME:IDX`, IDX counting from 0."""
    from gateway.core.tool_parsers import kimi_k2 as k

    return (
        k.SECTION_BEGIN
        + "".join(
            f"{k.CALL_BEGIN}functions.{n}:{i}{k.ARGUMENTS}{json.dumps(a)}{k.CALL_END}"
            for i, (n, a) in enumerate(calls)
        )
        + k.SECTION_END
    )


def harmony(calls: list[Call]) -> str:
    """As gpt-oss writes calls (the reply's first message has no `<|start|>assistant`: the
    generation prompt wrote it); one a reply, where gpt-oss stops, several as later messages."""
    return "<|start|>assistant".join(
        f"<|channel|>commentary to=functions.{n} <|constrain|>json<|message|>"
        f"{json.dumps(a)}<|call|>"
        for n, a in calls
    )


def minimax_m2(calls: list[Call]) -> str:
    """As MiniMax-M2's template writes calls: one block, bare strings, JSON otherwise."""
    return (
        "<minimax:tool_call>\n"
        + "".join(
            f'<invoke name="{n}">\n'
            + "".join(f'<parameter name="{k}">{qwen3_value(v)}</parameter>\n' for k, v in a.items())
            + "</invoke>\n"
            for n, a in calls
        )
        + "</minimax:tool_call>"
    )


FORMATS: dict[str, tuple[ToolCallParser, Callable[[list[Call]], str]]] = {
    "hermes": (HermesParser(), hermes),
    "qwen3_coder": (Qwen3CoderParser(), qwen3),
    "llama3_json": (Llama3JsonParser(), llama3),
    "mistral_v3": (MistralParser(), mistral_v3),
    "mistral_v11": (MistralParser(), mistral_v11),
    "glm45": (Glm45Parser(), glm45),
    "minimax_m2": (MinimaxM2Parser(), minimax_m2),
    "granite": (GraniteParser(), granite),
    "phi4_mini_json": (Phi4MiniJsonParser(), phi4_mini),
    "deepseek_v31": (DeepseekV31Parser(), deepseek_v31),
    "kimi_k2": (KimiK2Parser(), kimi_k2),
    "openai": (OpenAIParser(), harmony),
}
"""Formats whose names and keys are free text; `pythonic` (Llama 4) takes Python identifiers."""
