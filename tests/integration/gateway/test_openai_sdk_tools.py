"""The official `openai` SDK calling tools against a real `rlgateway serve` on the scripted model
(greedy decoding really calls the `add` tool and then answers "The sum is 5."): a tool call, the
same call streamed, and a five-turn tool conversation recorded as one exact segment."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.support.gateway_server import GatewayHandle
from tests.support.openai_clients import admin_client, async_client, sync_client, user
from tests.support.recording import (
    check_segment,
    check_teacher_forced,
    only_segment,
    tokenizer_of,
)
from tests.support.scripted_model import ANSWER, QUESTIONS, TOOLS

pytestmark = pytest.mark.slow

CALL_ARGS = {"a": 2, "b": 3}


# -- tools on the scripted model ----------------------------------------------------------------


def _assert_add_call(name: str | None, arguments: str | None) -> None:
    assert name == "add"
    assert arguments is not None
    assert json.loads(arguments) == CALL_ARGS


@pytest.mark.parametrize(
    "tool_choice",
    [None, "auto", "required", {"type": "function", "function": {"name": "add"}}],
    ids=["default", "auto", "required", "named"],
)
def test_tool_call(scripted_gw: GatewayHandle, tool_choice: Any) -> None:
    s = scripted_gw.new_session()
    extra = {} if tool_choice is None else {"tool_choice": tool_choice}
    with sync_client(s) as client:
        r = client.chat.completions.create(
            model="scripted",
            messages=[user(QUESTIONS[0])],
            tools=TOOLS,
            temperature=0,
            max_tokens=64,
            **extra,
        )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.content
    calls = choice.message.tool_calls
    assert calls is not None
    assert len(calls) == 1
    assert calls[0].type == "function"
    assert calls[0].id
    _assert_add_call(calls[0].function.name, calls[0].function.arguments)
    detail = scripted_gw.session(s["id"])
    assert detail["finish_reasons"] == {r.id: "tool_calls"}


async def test_streamed_tool_call_assembles_into_the_same_call(scripted_gw: GatewayHandle) -> None:
    s = scripted_gw.new_session()
    async with async_client(s) as client:
        stream = await client.chat.completions.create(
            model="scripted",
            messages=[user(QUESTIONS[0])],
            tools=TOOLS,
            temperature=0,
            max_tokens=64,
            stream=True,
        )
        calls: dict[int, dict[str, Any]] = {}
        content = ""
        finish = None
        async with stream:
            async for chunk in stream:
                for c in chunk.choices:
                    content += c.delta.content or ""
                    finish = c.finish_reason or finish
                    for d in c.delta.tool_calls or []:
                        call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                        call["id"] = d.id or call["id"]
                        if d.function is not None:
                            call["name"] += d.function.name or ""
                            call["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls"
    assert content == ""  # no tool-call markup leaks into the content
    assert list(calls) == [0]
    assert calls[0]["id"]
    _assert_add_call(calls[0]["name"], calls[0]["arguments"])


# -- the five-turn tool conversation, proved against the engine and the model ------------------


async def test_five_turn_tool_conversation_is_one_exact_segment(
    scripted_gw: GatewayHandle, scripted_dir: Path
) -> None:
    s = scripted_gw.new_session()
    messages: list[dict[str, Any]] = []
    ids: list[str] = []
    prompts: list[list[dict[str, Any]]] = []

    async def turn(client: openai.AsyncOpenAI) -> Any:
        prompts.append(list(messages))
        r = await client.chat.completions.create(
            model="scripted",
            messages=messages,
            tools=TOOLS,
            temperature=0,
            max_tokens=64,
        )
        ids.append(r.id)
        messages.append(r.choices[0].message.model_dump())  # what an agent appends
        return r.choices[0]

    async with async_client(s) as client:
        for round_ in range(3):
            messages.append(user(QUESTIONS[round_]))
            choice = await turn(client)
            assert choice.finish_reason == "tool_calls", choice
            call = choice.message.tool_calls[0]
            _assert_add_call(call.function.name, call.function.arguments)
            if round_ == 2:
                break
            result = json.loads(call.function.arguments)
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": str(sum(result.values()))}
            )
            choice = await turn(client)
            assert choice.finish_reason == "stop", choice
            assert choice.message.content == ANSWER
            assert not choice.message.tool_calls

    detail = scripted_gw.session(s["id"])
    assert detail["prefix_breaks"] == 0
    seg = only_segment(detail)
    assert seg["completion_ids"] == ids
    check_segment(seg)
    assert detail["finish_reasons"] == dict(
        zip(ids, ["tool_calls", "stop", "tool_calls", "stop", "tool_calls"], strict=True)
    )
    tokens = seg["tokens"]
    spans = seg["turn_spans"]
    assert spans[-1][1] == len(tokens)

    tok = tokenizer_of(scripted_dir)
    with admin_client(scripted_gw) as admin:
        for k, (start, end) in enumerate(spans):
            # what the engine was given: the chat template over the agent's messages
            rendered = tok.apply_chat_template(
                prompts[k], tools=TOOLS, add_generation_prompt=True, tokenize=False
            )
            assert tok.decode(tokens[:start], skip_special_tokens=False) == rendered
            # what it produced: greedy decoding from the recorded prompt gives the recorded turn
            replay = admin.completions.create(
                model="scripted", prompt=tokens[:start], temperature=0, max_tokens=end - start
            )
            assert replay.choices[0].text == tok.decode(tokens[start:end], skip_special_tokens=True)
            assert replay.usage is not None
            assert replay.usage.completion_tokens == end - start
    # and with these probabilities: a teacher-forced pass over the segment (greedy: T = 1)
    check_teacher_forced(scripted_dir, seg, temperature=1.0)
    # the admin's replays were not recorded into the session
    assert scripted_gw.session(s["id"])["segments"] == detail["segments"]
