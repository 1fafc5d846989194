"""Bugs reported against comparable systems, each a test against a real `rlgateway serve` on the
scripted model (greedy: the `add` call, then "The sum is 5."), with the official `openai` SDK.

- Streamed tool calls lose no token ids, and a call's `id` is present and stable across chunks.
- Tool-call `arguments` sent back as a JSON string or as an object render the same prompt, the
  one the chat template renders.
- A tool schema with or without `strict` renders the same prompt ids, the chat template's.

(A client that times out and retries leaves no orphan turn that is trained:
`test_unseen_turns.py::test_sdk_retries_after_timeouts_train_no_turn_the_agent_never_saw`, on
every protocol.)
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.support.gateway_server import GatewayHandle
from tests.support.recording import check_segment, only_segment, tokenizer_of
from tests.support.scripted_model import CALL, QUESTIONS, TOOLS

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": QUESTIONS[0]}]


def client_of(s: dict[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)


def template_prompt(model_dir: Path, messages: list[dict[str, Any]]) -> list[int]:
    tok = tokenizer_of(model_dir)
    text = tok.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    return list(tok.encode(text, add_special_tokens=False))


def first_prompt(gw: GatewayHandle, s: dict[str, Any], turn: int = 0) -> list[int]:
    seg = only_segment(gw.session(s["id"]))
    check_segment(seg)
    start = seg["turn_spans"][turn][0]
    tokens: list[int] = seg["tokens"][:start]
    return tokens


def test_streamed_tool_calls_lose_no_tokens_and_keep_their_id(scripted_gw: GatewayHandle) -> None:
    s = scripted_gw.new_session()
    with client_of(s) as client:
        chunks = list(
            client.chat.completions.create(
                model="m",
                messages=QUESTION,  # type: ignore[arg-type]
                tools=TOOLS,  # type: ignore[arg-type]
                temperature=0,
                stream=True,
                logprobs=True,
            )
        )
    logprobs = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content or []
    ]
    calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert calls, "no tool call was streamed"
    assert {t.id for t in calls} == {calls[0].id}
    assert calls[0].id
    assert calls[0].function is not None
    assert calls[0].function.name == "add"
    assert json.loads(calls[0].function.arguments or "") == CALL["arguments"]
    # every sampled token reached the client (its logprob) though the call's text was held back
    seg = only_segment(scripted_gw.session(s["id"]))
    [(start, end)] = seg["turn_spans"]
    assert len(logprobs) == end - start
    assert [e.logprob for e in logprobs] == pytest.approx(seg["logprobs"][start:end], abs=1e-6)


@pytest.mark.parametrize("form", ["string", "object"])
def test_tool_call_arguments_as_a_string_or_an_object_render_the_same(
    scripted_gw: GatewayHandle, scripted_dir: Path, form: str
) -> None:
    s = scripted_gw.new_session()
    with client_of(s) as client:
        r = client.chat.completions.create(
            model="m",
            messages=QUESTION,
            tools=TOOLS,
            temperature=0,  # type: ignore[arg-type]
        )
        echoed = r.choices[0].message.model_dump(exclude_none=True)
        call = echoed["tool_calls"][0]
        if form == "object":
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        tool = {"role": "tool", "tool_call_id": call["id"], "content": "5"}
        client.chat.completions.create(
            model="m",
            messages=[*QUESTION, echoed, tool],  # type: ignore[list-item]
            tools=TOOLS,  # type: ignore[arg-type]
            temperature=0,
        )
    history = [
        *QUESTION,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": CALL}],
        },
        tool,
    ]
    assert first_prompt(scripted_gw, s, turn=1) == template_prompt(scripted_dir, history)


@pytest.mark.parametrize("strict", [None, True, False])
def test_a_tool_schema_renders_the_same_with_or_without_strict(
    scripted_gw: GatewayHandle, scripted_dir: Path, strict: bool | None
) -> None:
    tools = copy.deepcopy(TOOLS)
    if strict is not None:
        tools[0]["function"]["strict"] = strict
    s = scripted_gw.new_session()
    with client_of(s) as client:
        client.chat.completions.create(
            model="m",
            messages=QUESTION,
            tools=tools,
            temperature=0,  # type: ignore[arg-type]
        )
    assert first_prompt(scripted_gw, s) == template_prompt(scripted_dir, QUESTION)
