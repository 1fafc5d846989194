"""Forced tool calls held to the tool's schema, through a real `rlgateway serve` on the random tiny
model (hermes format), which writes arbitrary bytes unconstrained: under `tool_choice` required or
a named tool, the `openai` SDK (chat, streamed chat, Responses) and the `anthropic` SDK get a call
of a declared tool whose arguments validate against its `parameters`. The turn's record names the
grammar (the trainer trains it as a constrained turn), the call sent back in the history
continues the same segment token for token, and a tool schema that cannot be held is a 400 that
commits nothing."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from tests.support.gateway_server import GatewayHandle
from tests.support.openai_clients import sync_client, user
from tests.support.recording import check_segment, only_segment

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
NOTE = {
    "type": "object",
    "properties": {"text": {"type": "string", "maxLength": 6}},
    "required": ["text"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "take_note": NOTE}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": n, "parameters": p}} for n, p in SCHEMAS.items()
]


def valid(name: str, arguments: str | dict[str, Any]) -> None:
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(args, SCHEMAS[name])


def recorded_grammar(gw: GatewayHandle, session_id: str) -> list[str]:
    seg = only_segment(gw.session(session_id))
    check_segment(seg)
    return [sampling.get("grammar") for sampling in seg["turn_sampling"]]


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "take_note"}}],
    ids=["required", "named"],
)
def test_chat_gets_a_valid_call_and_the_next_turn_continues_its_segment(
    tiny_gw: GatewayHandle, tool_choice: Any
) -> None:
    for seed in range(3):
        s = tiny_gw.new_session()
        messages: list[Any] = [user("Weather or note?")]
        with sync_client(s) as client:
            r = client.chat.completions.create(
                model="tiny",
                messages=messages,
                tools=TOOLS,
                tool_choice=tool_choice,
                parallel_tool_calls=False,
                max_tokens=200,
                seed=seed,
            )
            choice = r.choices[0]
            assert choice.finish_reason == "tool_calls", choice.message.content
            [call] = choice.message.tool_calls or []
            fn = call.function  # type: ignore[union-attr]
            if isinstance(tool_choice, dict):
                assert fn.name == "take_note"
            valid(fn.name, fn.arguments)
            # the agent runs the tool and sends its call back: the same segment goes on
            messages += [
                choice.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "done"},
            ]
            client.chat.completions.create(
                model="tiny", messages=messages, tools=TOOLS, max_tokens=4, seed=seed
            )
        first, second = recorded_grammar(tiny_gw, s["id"])
        assert first is not None
        assert "%json" in first
        assert second is None  # tool_choice auto: nothing forced, nothing held


def test_a_streamed_required_call_assembles_into_valid_calls(tiny_gw: GatewayHandle) -> None:
    s = tiny_gw.new_session()
    with sync_client(s) as client:
        stream = client.chat.completions.create(
            model="tiny",
            messages=[user("Go.")],
            tools=TOOLS,
            tool_choice="required",
            max_tokens=300,
            seed=7,
            stream=True,
        )
        calls: dict[int, dict[str, str]] = {}
        finish = None
        first_deltas = 0
        for chunk in stream:
            for delta in chunk.choices[0].delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                first_deltas += delta.index == 0
                if delta.function is not None:
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert calls
    for call in calls.values():
        valid(call["name"], call["arguments"])
    assert first_deltas > 3  # the first call, its name read from the reply, streamed as sampled


def test_a_streamed_named_call_streams_its_arguments_as_they_are_sampled(
    tiny_gw: GatewayHandle,
) -> None:
    """A call forced by name cannot be malformed (its grammar holds it), so its arguments stream
    in many deltas, the first with its id and name; the SDK's own assembly (`stream()`) gives
    the valid call, and the history sent back continues the segment. (Under `auto` a reply's
    calls come whole in its last chunk: `test_tool_call_shapes.py`.)"""
    s = tiny_gw.new_session()
    named = {"type": "function", "function": {"name": "get_weather"}}
    with sync_client(s) as client:
        request = {"model": "tiny", "messages": [user("Weather?")], "tools": TOOLS, "seed": 3}
        with client.chat.completions.stream(**request, tool_choice=named, max_tokens=200) as st:
            deltas = [
                d
                for chunk in st
                if chunk.type == "chunk"
                for d in chunk.chunk.choices[0].delta.tool_calls or []
            ]
            final = st.get_final_completion()
        [call] = final.choices[0].message.tool_calls or []
        assert final.choices[0].finish_reason == "tool_calls"
        assert call.function.name == "get_weather"
        valid(call.function.name, call.function.arguments)
        assert len(deltas) > 3  # the arguments came as they were sampled
        assert (deltas[0].id, deltas[0].function.name) == (call.id, "get_weather")  # type: ignore[union-attr]
        assert all(d.id is None for d in deltas[1:])
        text = "".join(d.function.arguments or "" for d in deltas)  # type: ignore[union-attr]
        assert json.loads(text) == json.loads(call.function.arguments)
        history = [
            user("Weather?"),
            final.choices[0].message.model_dump(exclude_none=True, exclude={"parsed"}),
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
        ]
        client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=2)
    seg = only_segment(tiny_gw.session(s["id"]))  # one segment: the streamed call continued
    check_segment(seg)


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_responses_named_function_call(tiny_gw: GatewayHandle, streamed: bool) -> None:
    """Streamed, the call's arguments come in many `response.function_call_arguments.delta`
    events (its grammar keeps it valid), which the SDK assembles into the same call."""
    s = tiny_gw.new_session()
    tools: list[Any] = [{"type": "function", **t["function"]} for t in TOOLS]
    request: Any = {
        "model": "tiny",
        "input": "The weather?",
        "tools": tools,
        "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 200,
    }
    with sync_client(s) as client:
        if streamed:
            with client.responses.stream(**request) as stream:
                kinds = [event.type for event in stream]
                r = stream.get_final_response()
            assert kinds.count("response.function_call_arguments.delta") > 3
            assert kinds.count("response.output_item.added") == 1
        else:
            r = client.responses.create(**request)
    [call] = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather"
    valid(call.name, call.arguments)
    assert recorded_grammar(tiny_gw, s["id"])[0] is not None


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_messages_named_tool_use(tiny_gw: GatewayHandle, streamed: bool) -> None:
    """Streamed, the tool use's input comes in many `input_json_delta` events."""
    s = tiny_gw.new_session()
    client = anthropic.Anthropic(
        base_url=s["base_url"].removesuffix("/v1"), api_key=s["api_key"], max_retries=0
    )
    request: Any = {
        "model": "tiny",
        "max_tokens": 200,
        "messages": [{"role": "user", "content": "A note."}],
        "tools": [{"name": n, "input_schema": p} for n, p in SCHEMAS.items()],
        "tool_choice": {"type": "tool", "name": "take_note", "disable_parallel_tool_use": True},
    }
    if streamed:
        with client.messages.stream(**request) as stream:
            deltas = [
                e
                for e in stream
                if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
            ]
            m = stream.get_final_message()
        assert len(deltas) > 3
    else:
        m = client.messages.create(**request)
    assert m.stop_reason == "tool_use"
    [use] = [block for block in m.content if block.type == "tool_use"]
    assert use.name == "take_note"
    valid(use.name, use.input)  # type: ignore[arg-type]


def test_a_tool_schema_that_cannot_be_held_is_a_400_that_commits_nothing(
    tiny_gw: GatewayHandle,
) -> None:
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]
    s = tiny_gw.new_session()
    url, key = f"{s['base_url']}/chat/completions", {"authorization": f"Bearer {s['api_key']}"}
    body = {"model": "tiny", "messages": [user("x")], "tools": bad, "max_tokens": 4}
    r = httpx.post(url, json={**body, "tool_choice": "required"}, headers=key)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "tool_choice forces a call" in error["message"]
    assert tiny_gw.session(s["id"])["segments"] == []
    # nothing forced, nothing held: the same tools serve
    assert httpx.post(url, json=body, headers=key).status_code == 200
