"""gpt-oss's harmony format (`gateway.core.harmony`), read as the model writes it and as its own
chat template (`tests/support/templates/gpt_oss.jinja`, as its model card publishes it) writes it
back: the analysis channel is the reasoning, the final channel the answer, a commentary message to
`functions.NAME` a call; a reply in flight shows no markup; the template picks both parsers."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.core import harmony
from gateway.core.reasoning_parsers import HarmonyParser, detect_reasoning_parser
from gateway.core.tool_parsers import OpenAIParser, detect_tool_parser
from tests.support.paths import REPO_ROOT
from tests.support.tool_formats import calls_of

TEMPLATE = (REPO_ROOT / "tests" / "support" / "templates" / "gpt_oss.jinja").read_text()
THINK = "<|channel|>analysis<|message|>The user wants the weather.<|end|><|start|>assistant"
CALL = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}'
WEATHER = [("get_weather", {"city": "Oslo"})]


def read(text: str) -> tuple[str | None, list[Any], str | None]:
    """(content, calls, reasoning) as the gateway reads a reply: reasoning first, then calls."""
    split = HarmonyParser().split(text, opened=False)
    content, calls = OpenAIParser().parse(split.answer)
    return content, calls_of((content, calls)), split.reasoning


def test_the_template_picks_both_parsers() -> None:
    assert detect_tool_parser(TEMPLATE) == "openai"
    assert detect_reasoning_parser(TEMPLATE) == "openai_gptoss"


def test_reasoning_then_an_answer() -> None:
    text = THINK + "<|channel|>final<|message|>It is sunny.<|return|>"
    assert read(text) == ("It is sunny.", [], "The user wants the weather.")


def test_reasoning_then_a_call() -> None:
    assert read(THINK + CALL + "<|call|>") == (None, WEATHER, "The user wants the weather.")


def test_a_preamble_is_content_and_the_recipient_may_come_first() -> None:
    preamble = "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant"
    first = ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|>'
    assert read(preamble + first.lstrip()) == ("Checking.", WEATHER, None)
    assert read(first) == (None, WEATHER, None)


@pytest.mark.parametrize(
    "body",
    ['{"city": "Oslo"', "[1, 2]", "not json"],
    ids=["cut", "not-an-object", "text"],
)
def test_a_malformed_call_is_text(body: str) -> None:
    text = CALL.replace('{"city": "Oslo"}', body) + "<|call|>"
    content, calls, _ = read(text)
    assert calls == []
    assert content == text


def test_a_built_in_tools_recipient_is_no_call_of_the_requests() -> None:
    text = '<|channel|>commentary to=browser.search <|constrain|>json<|message|>{"q": "x"}<|call|>'
    content, calls, _ = read(text)
    assert calls == []
    assert content == text


def test_a_reply_without_the_format_is_its_text() -> None:
    assert read("Just text.") == ("Just text.", [], None)


def test_in_flight_the_answer_waits_for_the_next_header() -> None:
    """While the reasoning streams, nothing is shown as the answer; once a final message's
    header is written, its body is; a call's header is never the answer's text."""
    parser = HarmonyParser()
    assert parser.split("<|channel|>analysis<|message|>The us", opened=False).done is False
    mid = THINK + "<|channel|>fin"
    split = parser.split(mid, opened=False)
    assert (split.reasoning, split.answer, split.done) == ("The user wants the weather.", "", False)
    split = parser.split(THINK + "<|channel|>final<|message|>It is", opened=False)
    assert (split.answer, split.done) == ("It is", True)


def test_the_templates_own_call_reads_back() -> None:
    """The template writes a call back recipient first (`<|start|>assistant to=functions.NAME
    <|channel|>commentary json<|message|>...<|call|>`): read as the same call."""
    from transformers.utils.chat_template_utils import render_jinja_template

    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather."}}]
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "thinking": "Look it up.", "tool_calls": [call]},
    ]
    [whole], _ = render_jinja_template(
        conversations=[messages], chat_template=TEMPLATE, tools=tools
    )
    reply = str(whole).split("<|start|>user<|message|>Weather?<|end|><|start|>assistant", 1)[1]
    assert read(reply) == (None, WEATHER, "Look it up.")
    assert json.loads(harmony.read(reply).messages[-1].body) == {"city": "Oslo"}


def test_the_renderer_hands_the_reasoning_to_the_template_under_its_key(tiny_model: Any) -> None:
    """The gateway keeps an assistant's reasoning as `reasoning_content`; gpt-oss's template reads
    `thinking` only, so the renderer renames it (`ChatRenderer.reasoning_key`) and the history
    the model sees holds its analysis; a template that reads `reasoning_content` gets it as is."""
    import copy

    from engines.tiny_model import load_tokenizer
    from gateway.core.chat_render import ChatRenderer

    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather."}}]
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Look it up.",
            "tool_calls": [call],
        },
        {"role": "tool", "content": "Sunny."},
    ]
    tokenizer = copy.deepcopy(load_tokenizer(tiny_model))
    assert ChatRenderer(tokenizer, frozenset()).reasoning_key == "reasoning_content"  # Qwen-like
    tokenizer.chat_template = TEMPLATE
    renderer = ChatRenderer(tokenizer, frozenset())
    assert renderer.reasoning_key == "thinking"
    text = renderer.render(messages, tools, add_generation_prompt=True)
    assert "<|channel|>analysis<|message|>Look it up.<|end|>" in text
