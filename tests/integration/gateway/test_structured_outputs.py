"""Structured outputs through a real `rlgateway serve` on the random tiny model, which writes
arbitrary bytes unconstrained: the `openai` SDK's `parse` (chat, streamed chat and Responses), the
OpenAI Agents SDK's `output_type` and LangChain's `with_structured_output` each get replies that
validate against their schema, unmodified but for `base_url`/`api_key`. The turn's record names
the schema (the trainer's contract reads it), and a schema that cannot be compiled is a 400 that
commits nothing."""

from __future__ import annotations

import json
from typing import Any, Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from tests.support.gateway_server import GatewayHandle
from tests.support.openai_clients import sync_client, user
from tests.support.recording import check_segment, only_segment, teacher_forced

pytestmark = pytest.mark.slow


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=30)
    indoor: bool


def recorded_schema(gw: GatewayHandle, session_id: str) -> dict[str, Any]:
    seg = only_segment(gw.session(session_id))
    check_segment(seg)
    [sampling] = seg["turn_sampling"]
    schema: dict[str, Any] = json.loads(sampling["json_schema"])
    return schema


def test_chat_parse_returns_a_valid_object_and_records_the_schema(
    tiny_gw: GatewayHandle, tiny_model: Any
) -> None:
    for seed in range(3):
        s = tiny_gw.new_session()
        with sync_client(s) as client:
            r = client.chat.completions.parse(
                model="tiny",
                messages=[user("Describe a pet.")],
                response_format=Pet,
                max_tokens=120,
                seed=seed,
            )
        choice = r.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Pet), choice.message.content
        assert recorded_schema(tiny_gw, s["id"])["properties"]["kind"]["enum"] == [
            "cat",
            "dog",
            "fish",
        ]
        # the behaviour logprobs are the masked distribution's: never below the model's own
        seg = only_segment(tiny_gw.session(s["id"]))
        free = teacher_forced(tiny_model, seg["tokens"], 1.0)
        [(start, end)] = seg["turn_spans"]
        assert all(seg["logprobs"][i] >= free[i] - 1e-4 for i in range(start, end))
        assert any(seg["logprobs"][i] > free[i] + 1e-3 for i in range(start, end))


def test_streamed_chat_parse_and_json_mode(tiny_gw: GatewayHandle) -> None:
    s = tiny_gw.new_session()
    with sync_client(s) as client:
        with client.chat.completions.stream(
            model="tiny", messages=[user("A pet?")], response_format=Pet, max_tokens=120, seed=4
        ) as stream:
            final = stream.get_final_completion()
        assert isinstance(final.choices[0].message.parsed, Pet)
        small = {"type": "object", "properties": {"yes": {"type": "boolean"}}, "required": ["yes"]}
        r = client.chat.completions.create(
            model="tiny",
            messages=[user("Yes?")],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "yes", "schema": small, "strict": False},
            },
            max_tokens=60,
            seed=1,
        )
    assert isinstance(json.loads(r.choices[0].message.content or ""), dict)


def test_responses_parse_and_its_text_format_echo(tiny_gw: GatewayHandle) -> None:
    s = tiny_gw.new_session()
    with sync_client(s) as client:
        r = client.responses.parse(
            model="tiny", input="Describe a pet.", text_format=Pet, max_output_tokens=120
        )
    assert isinstance(r.output_parsed, Pet), r.output_text
    assert r.text is not None
    assert r.text.format is not None
    assert r.text.format.type == "json_schema"  # the body says what was asked, not "text"
    assert recorded_schema(tiny_gw, s["id"])["required"] == ["kind", "name", "age", "indoor"]


async def test_the_agents_sdk_output_type(tiny_gw: GatewayHandle) -> None:
    from agents import Agent, OpenAIResponsesModel, Runner, set_tracing_disabled

    set_tracing_disabled(True)
    s = tiny_gw.new_session()
    client = openai.AsyncOpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
    agent = Agent(
        name="pets",
        instructions="Describe a pet.",
        output_type=Pet,
        model=OpenAIResponsesModel(model="tiny", openai_client=client),
    )
    result = await Runner.run(agent, "A pet, please.")
    await client.close()
    assert isinstance(result.final_output, Pet)
    recorded_schema(tiny_gw, s["id"])


def test_langchain_with_structured_output(tiny_gw: GatewayHandle) -> None:
    from langchain_openai import ChatOpenAI

    s = tiny_gw.new_session()
    llm = ChatOpenAI(
        model="tiny", base_url=s["base_url"], api_key=s["api_key"], max_retries=0, max_tokens=120
    )
    pet = llm.with_structured_output(Pet).invoke("Describe a pet.")
    assert isinstance(pet, Pet)
    recorded_schema(tiny_gw, s["id"])


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "chat/completions",
            {
                "messages": [user("x")],
                "response_format": {"type": "json_schema", "json_schema": {"name": "x"}},
            },
            "response_format",
        ),
        (
            "chat/completions",
            {
                "messages": [user("x")],
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "strin"}},
                },
            },
            "response_format",
        ),
        (
            "chat/completions",
            {"messages": [user("x")], "response_format": {"type": "yaml"}},
            "response_format",
        ),
        ("chat/completions", {"messages": [user("x")], "guided_regex": "a+"}, "guided_regex"),
        (
            "responses",
            {"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}},
            "text.format",
        ),
    ],
)
def test_a_format_that_cannot_be_served_is_a_400_that_commits_nothing(
    tiny_gw: GatewayHandle, path: str, body: dict[str, Any], param: str
) -> None:
    s = tiny_gw.new_session()
    r = httpx.post(
        f"{s['base_url']}/{path}",
        json={"model": "tiny", **body},
        headers={"authorization": f"Bearer {s['api_key']}"},
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert tiny_gw.session(s["id"])["segments"] == []


def test_anthropic_sdk_output_format(tiny_gw: GatewayHandle) -> None:
    import anthropic

    s = tiny_gw.new_session()
    client = anthropic.Anthropic(
        base_url=s["base_url"].removesuffix("/v1"), api_key=s["api_key"], max_retries=0
    )
    # Anthropic's structured outputs ask for closed objects, as OpenAI's strict mode does
    fmt = {
        "type": "json_schema",
        "schema": {**Pet.model_json_schema(), "additionalProperties": False},
    }
    m = client.messages.create(
        model="tiny",
        max_tokens=120,
        messages=[{"role": "user", "content": "Describe a pet."}],
        extra_body={"output_format": fmt},
    )
    [block] = m.content
    assert block.type == "text"
    Pet.model_validate_json(block.text)
    assert recorded_schema(tiny_gw, s["id"])["title"] == "Pet"
