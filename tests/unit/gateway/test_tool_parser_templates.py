"""Tool-call parsers against what model families really write: bare values read by their
parameter's declared type, and each family's own chat template (as its model card publishes it,
in `tests/support/templates/`) detected and its rendered calls read back."""

from __future__ import annotations

import json
from typing import Any

from gateway.core.tool_parsers import (
    Glm45Parser,
    Parsed,
    Qwen3CoderParser,
    detect_tool_parser,
)
from tests.support.paths import REPO_ROOT

Call = tuple[str, dict[str, Any]]


def calls_of(parsed: Parsed) -> list[Call]:
    return [(c.name, json.loads(c.arguments)) for c in parsed[1]]


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
"""Model families' chat templates as their model cards publish them."""


def test_glm45s_real_template_is_detected_and_its_calls_read_back() -> None:
    """GLM-4.5's own template (zai-org/GLM-4.5, as GLM-4.6 ships it) renders an assistant turn
    with calls; reading that turn back gives the content and the calls, values typed."""
    from transformers.utils.chat_template_utils import render_jinja_template

    template = (REAL_TEMPLATES / "glm45.jinja").read_text()
    assert detect_tool_parser(template) == "glm45"
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
    user = [{"role": "user", "content": "Weather?"}]
    assistant = {
        "role": "assistant",
        "content": "Let me check.",
        "tool_calls": [
            {"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls
        ],
    }

    def render(messages: list[Any], add: bool) -> str:
        [text], _ = render_jinja_template(
            conversations=[messages],
            chat_template=template,
            tools=tools,
            add_generation_prompt=add,
        )
        return str(text)

    prompt = render(user, True)
    whole = render([*user, assistant], False)
    assert whole.startswith(prompt)
    reply = whole[len(prompt) :]
    answer = reply.split("</think>", 1)[1]  # the template writes an empty think block
    content, parsed = Glm45Parser().parse(answer, tools)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == calls
