"""Tool-call parsers against what model families really write: bare values read by their
parameter's declared type, and each family's own chat template (as its model card publishes it,
in `tests/support/templates/`) detected and its rendered calls read back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gateway.core.tool_parsers import (
    TOOL_PARSERS,
    Glm45Parser,
    Qwen3CoderParser,
    detect_tool_parser,
)
from tests.support.paths import REPO_ROOT
from tests.support.tool_formats import Call, calls_of


def assistant_calling(calls: list[Call], content: str) -> dict[str, Any]:
    """An assistant message with `calls` (arguments as objects, as the gateway renders them)."""
    return {
        "role": "assistant",
        "content": content,
        "tool_calls": [
            {"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls
        ],
    }


def test_bare_values_are_read_by_their_declared_type() -> None:
    """GLM and Qwen3-Coder write strings bare: "42" for a `string` parameter is the string, as
    the template wrote it; undeclared, it reads as JSON."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {"properties": {"code": {"type": "string"}, "n": {}}},
            },
        }
    ]
    glm = "<tool_call>f\n<arg_key>code</arg_key>\n<arg_value>42</arg_value>\n"
    glm += "<arg_key>n</arg_key>\n<arg_value>42</arg_value>\n</tool_call>"
    qwen = "<tool_call>\n<function=f>\n<parameter=code>\n42\n</parameter>\n"
    qwen += "<parameter=n>\n42\n</parameter>\n</function>\n</tool_call>"
    for parser, text in ((Glm45Parser(), glm), (Qwen3CoderParser(), qwen)):
        assert calls_of(parser.parse(text, tools)) == [("f", {"code": "42", "n": 42})]
        assert calls_of(parser.parse(text)) == [("f", {"code": 42, "n": 42})]


REAL_TEMPLATES = REPO_ROOT / "tests" / "support" / "templates"
"""Model families' chat templates as their model cards publish them (Llama-4's and Phi-4-mini's
as vLLM's examples give them for their tool formats)."""


FAMILIES = {
    # family: (the assistant turn's header, the end of turn the engine stops on and drops)
    "glm45": ("<|assistant|>", ""),
    "minimax_m2": ("]~b]ai\n", "[e~[\n"),
    "qwen3_coder": ("<|im_start|>assistant", "<|im_end|>\n"),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_familys_own_template_is_detected_and_its_calls_read_back(family: str) -> None:
    """The family's own template (tests/support/templates/, from its model card: GLM-4.5's as
    GLM-4.6 ships it, MiniMax-M2's, Qwen3-Coder's) renders an assistant turn with calls;
    detection picks the family's parser, and reading the turn back gives the content and the
    calls, values typed."""
    from transformers.utils.chat_template_utils import render_jinja_template

    template = (REAL_TEMPLATES / f"{family}.jinja").read_text()
    assert detect_tool_parser(template) == family
    tools: list[Any] = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string"},
                        "days": {"type": "integer"},
                        "code": {"type": "string"},
                        "filters": {"type": "object"},
                    },
                },
            },
        }
    ]
    calls: list[Call] = [
        ("get_weather", {"city": "Paris", "days": 2, "code": "75", "filters": {"n": [1, 2]}}),
        ("get_weather", {"city": "Tōkyō\nJapan"}),
    ]
    assistant = assistant_calling(calls, "Let me check.")
    [whole], _ = render_jinja_template(
        conversations=[[{"role": "user", "content": "Weather?"}, assistant]],
        chat_template=template,
        tools=tools,
    )
    header, turn_end = FAMILIES[family]
    reply = str(whole).rsplit(header, 1)[1].removesuffix(turn_end)
    answer = reply.split("</think>", 1)[-1]  # the reasoning parser's part
    content, parsed = TOOL_PARSERS[family]().parse(answer, tools)
    assert content == "Let me check."
    assert calls_of((content, parsed)) == calls


@pytest.mark.parametrize(
    ("family", "expected"),
    [
        ("glm45", "glm45"),
        ("minimax_m2", "minimax_m2"),
        ("granite", "granite"),
        ("phi4_mini_json", "phi4_mini_json"),
        ("deepseek_v31", "deepseek_v31"),
        ("kimi_k2", "kimi_k2"),
        ("llama4_pythonic", "llama4_pythonic"),
        ("gpt_oss", "openai"),
        ("qwen3_coder", "qwen3_coder"),
        ("llama3_json", "llama3_json"),
    ],
)
def test_each_familys_own_template_picks_its_parser_or_none(
    family: str, expected: str | None
) -> None:
    template = (REAL_TEMPLATES / f"{family}.jinja").read_text()
    assert detect_tool_parser(template) == expected


def test_granite_and_phi4_mini_read_what_their_models_write() -> None:
    """The replies their model cards show (Granite's HF template renders no calls back into the
    history, and Phi-4-mini's renders them as Python reprs, so these are read from the models'
    documented output)."""
    weather = {"city": "San Francisco", "unit": "celsius"}
    items = '[{"name": "get_weather", "arguments": {"city": "San Francisco", "unit": "celsius"}}, '
    items += '{"name": "get_time", "arguments": {"timezone": "America/Los_Angeles"}}]'
    expected = [("get_weather", weather), ("get_time", {"timezone": "America/Los_Angeles"})]
    granite = TOOL_PARSERS["granite"]().parse("<|tool_call|>" + items)
    assert granite[0] is None
    assert calls_of(granite) == expected
    phi = TOOL_PARSERS["phi4_mini_json"]().parse("I'll check both for you.\nfunctools" + items)
    assert phi[0] == "I'll check both for you."
    assert calls_of(phi) == expected


def test_llama4s_template_renders_calls_the_parser_reads_back() -> None:
    """Llama 4's pythonic template writes a call back into the history as the model writes it,
    every value in double quotes (its `"%s" | format` makes `2` the string `"2"`)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    template = (REAL_TEMPLATES / "llama4_pythonic.jinja").read_text()
    calls = [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"tz": "UTC"})]
    assistant = assistant_calling(calls, "")
    [whole], _ = render_jinja_template(
        conversations=[[{"role": "user", "content": "Weather?"}, assistant]],
        chat_template=template,
        bos_token="<|begin_of_text|>",
    )
    reply = str(whole).rsplit("<|header_start|>assistant<|header_end|>\n\n", 1)[1]
    parsed = TOOL_PARSERS["llama4_pythonic"]().parse(reply.removesuffix("<|eot|>"))
    assert parsed[0] is None
    assert calls_of(parsed) == [
        ("get_weather", {"city": "Paris", "days": "2"}),
        ("get_time", {"tz": "UTC"}),
    ]


def test_deepseek_v31s_template_takes_arguments_as_text_and_its_calls_read_back(
    tiny_model: Path,
) -> None:
    """DeepSeek-V3.1's template adds a call's arguments to a string: the renderer learns from
    the TypeError that it takes them as JSON text, and the calls it renders read back."""
    from engines.tiny_model import load_tokenizer
    from gateway.core.chat_render import ChatRenderer
    from gateway.core.tool_parsers import deepseek_v31 as ds

    tokenizer = load_tokenizer(tiny_model)
    tokenizer.chat_template = (REAL_TEMPLATES / "deepseek_v31.jinja").read_text()
    renderer = ChatRenderer(tokenizer, frozenset())
    assert not renderer.arguments_as_text
    calls: list[Call] = [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Tokyo"})]
    assistant = assistant_calling(calls, "I'll look up both cities.")
    history = [
        {"role": "user", "content": "Weather?"},
        assistant,
        {"role": "tool", "content": "18C"},
        {"role": "user", "content": "Thanks"},
    ]
    text = renderer.render(history, None, add_generation_prompt=True)
    assert renderer.arguments_as_text
    reply = text.split("</think>", 1)[1].split(ds.CALLS_END, 1)[0] + ds.CALLS_END
    content, parsed = TOOL_PARSERS["deepseek_v31"]().parse(reply)
    assert content == "I'll look up both cities."
    assert calls_of((content, parsed)) == calls


def test_kimis_own_template_writes_the_ids_the_parser_returns() -> None:
    """Kimi-K2's template writes each call with its id and heads each result with it: the calls
    it renders read back with those ids (what the client gets, and sends back), and a result
    names the call as the model wrote it."""
    from transformers.utils.chat_template_utils import render_jinja_template

    template = (REAL_TEMPLATES / "kimi_k2.jinja").read_text()
    calls = [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]
    ids = ["functions.get_weather:0", "functions.get_time:1"]
    assistant = assistant_calling(calls, "Let me check.")
    for call, call_id in zip(assistant["tool_calls"], ids, strict=True):
        call["id"] = call_id
    result = {"role": "tool", "tool_call_id": ids[0], "content": "sunny"}
    [whole], _ = render_jinja_template(
        conversations=[[{"role": "user", "content": "Weather?"}, assistant, result]],
        chat_template=template,
    )
    text = str(whole)
    reply = text.split("<|im_assistant|>assistant<|im_middle|>", 1)[1].split("<|im_end|>", 1)[0]
    content, parsed = TOOL_PARSERS["kimi_k2"]().parse(reply)
    assert content == "Let me check."
    assert calls_of((content, parsed)) == calls
    assert [c.id for c in parsed] == ids
    assert f"<|im_middle|>## Return of {ids[0]}\n" in text
