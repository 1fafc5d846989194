"""The Responses API with the official `openai` SDK and the OpenAI Agents SDK, unmodified but for
`base_url`/`api_key`, against a real `rlgateway serve`.

Two servers: the scripted model (greedy decoding calls the `add` tool, then answers "The sum is
5.") and the random tiny model. Besides what the SDK sees, every test reads the session back and
checks the recording: one token-exact segment per conversation, the prompt the chat template's
rendering, the behaviour logprobs the model's own (teacher forcing).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support.gateway_server import GatewayHandle
from tests.support.recording import (
    check_segment,
    check_teacher_forced,
    only_segment,
    tokenizer_of,
)
from tests.support.scripted_model import ANSWER, CALL, TOOLS

pytestmark = pytest.mark.slow

ADD = {"type": "function", "name": "add", "parameters": TOOLS[0]["function"]["parameters"]}
QUESTION = "What is 2 plus 3?"


def client_of(session: dict[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)


def rendered(model_dir: Path, messages: list[dict[str, Any]], tools: Any = None) -> list[int]:
    """The chat template's prompt for these OpenAI messages, as token ids."""
    tok = tokenizer_of(model_dir)
    text = tok.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False
    )
    return list(tok.encode(text, add_special_tokens=False))


def call_of(response: Any) -> Any:
    [call] = [o for o in response.output if o.type == "function_call"]
    return call


# -- one turn -----------------------------------------------------------------------------------


def test_string_input_is_recorded_exactly_and_its_logprobs_are_the_models(
    tiny_gw: GatewayHandle, tiny_model: Path
) -> None:
    s = tiny_gw.new_session()
    with client_of(s) as client:
        r = client.responses.create(
            model="tiny",
            input="Tell me something.",
            max_output_tokens=12,
            include=["message.output_text.logprobs"],
            top_logprobs=2,
        )
    assert r.object == "response"
    assert r.id.startswith("resp_")
    assert r.status in {"completed", "incomplete"}
    seg = only_segment(tiny_gw.session(s["id"]))
    check_segment(seg)
    assert seg["completion_ids"] == [r.id]
    [(start, end)] = seg["turn_spans"]
    assert seg["tokens"][:start] == rendered(
        tiny_model, [{"role": "user", "content": "Tell me something."}]
    )
    assert r.usage is not None
    assert (r.usage.input_tokens, r.usage.output_tokens) == (start, end - start)
    # the text is the recorded tokens, decoded; the logprobs are the recorded ones
    tok = tokenizer_of(tiny_model)
    assert r.output_text == tok.decode(seg["tokens"][start:end], skip_special_tokens=True)
    [message] = r.output
    assert message.type == "message"
    lps = message.content[0].logprobs  # type: ignore[union-attr]
    assert lps is not None
    assert len(lps) == end - start
    for entry, recorded in zip(lps, seg["logprobs"][start:end], strict=True):
        assert entry.logprob == pytest.approx(recorded, abs=1e-6)
        assert len(entry.top_logprobs) == 2
    check_teacher_forced(tiny_model, seg, temperature=1.0)


def test_max_output_tokens_ends_incomplete_and_a_limit_past_the_context_is_capped(
    tiny_gw: GatewayHandle,
) -> None:
    s = tiny_gw.new_session()
    with client_of(s) as client:
        r = client.responses.create(model="tiny", input="Go.", max_output_tokens=3)
        assert r.status == "incomplete"
        assert r.incomplete_details is not None
        assert r.incomplete_details.reason == "max_output_tokens"
        assert r.usage is not None
        assert r.usage.output_tokens == 3
        # 2048 tokens of context: a limit of 100000 is a limit, not a refused demand; the reply
        # runs to the context's end, which Codex must hear as context_length_exceeded
        # (test_context_edge.py)
        with pytest.raises(openai.BadRequestError) as edge:
            client.responses.create(
                model="tiny",
                input="x" * 1900,
                max_output_tokens=100_000,
                extra_body={"ignore_eos": True},
            )
    assert edge.value.code == "context_length_exceeded"
    assert "left room for only" in str(edge.value)


# -- a conversation -----------------------------------------------------------------------------


def test_previous_response_id_chains_three_turns_as_one_segment(
    scripted_gw: GatewayHandle, scripted_dir: Path
) -> None:
    s = scripted_gw.new_session()
    with client_of(s) as client:
        kw: dict[str, Any] = {"model": "scripted", "tools": [ADD], "temperature": 0}
        r1 = client.responses.create(input=QUESTION, **kw)
        call = call_of(r1)
        assert (call.name, call.arguments) == ("add", '{"a": 2, "b": 3}')
        assert call.call_id.startswith("call_")
        assert call.id.startswith("fc_")
        output = [{"type": "function_call_output", "call_id": call.call_id, "output": "5"}]
        r2 = client.responses.create(previous_response_id=r1.id, input=output, **kw)
        assert r2.output_text == ANSWER
        r3 = client.responses.create(previous_response_id=r2.id, input="Add two and three.", **kw)
        assert call_of(r3).name == "add"
        # a kept response reads back as it was answered
        assert client.responses.retrieve(r2.id).model_dump() == r2.model_dump()

    detail = scripted_gw.session(s["id"])
    assert detail["prefix_breaks"] == 0
    seg = only_segment(detail)
    assert seg["completion_ids"] == [r1.id, r2.id, r3.id]
    check_segment(seg)
    chat_history = [
        {"role": "user", "content": QUESTION},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": CALL}],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "5"},
        {"role": "assistant", "content": ANSWER},
        {"role": "user", "content": "Add two and three."},
    ]
    for k, cut in enumerate([1, 3, 5]):
        start = seg["turn_spans"][k][0]
        assert seg["tokens"][:start] == rendered(scripted_dir, chat_history[:cut], TOOLS)
    check_teacher_forced(scripted_dir, seg, temperature=1.0)


def test_full_history_with_store_false_continues_the_segment_and_keeps_nothing(
    scripted_gw: GatewayHandle,
) -> None:
    s = scripted_gw.new_session()
    kw: dict[str, Any] = {"model": "scripted", "tools": [ADD], "temperature": 0, "store": False}
    with client_of(s) as client:
        question = [{"role": "user", "content": QUESTION}]
        r1 = client.responses.create(input=question, **kw)  # type: ignore[arg-type]
        call = call_of(r1)
        history = [
            *question,
            *[o.model_dump(exclude_none=True) for o in r1.output],
            {"type": "function_call_output", "call_id": call.call_id, "output": "5"},
        ]
        r2 = client.responses.create(input=history, **kw)
        assert r2.output_text == ANSWER
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(r1.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.create(previous_response_id=r1.id, input="again", **kw)
    seg = only_segment(scripted_gw.session(s["id"]))
    assert seg["completion_ids"] == [r1.id, r2.id]


# -- streaming ----------------------------------------------------------------------------------


def test_stream_sends_the_documented_events_and_its_text_is_the_final_text(
    tiny_gw: GatewayHandle, tiny_model: Path
) -> None:
    s = tiny_gw.new_session()
    with (
        client_of(s) as client,
        client.responses.stream(model="tiny", input="Say it.", max_output_tokens=16) as st,
    ):
        events = list(st)
    # the random model seldom ends by itself: the stream mostly ends `response.incomplete`,
    # which the SDK's `get_final_response` does not take, so read the last event's response
    final = events[-1].response  # type: ignore[union-attr]
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in {"response.completed", "response.incomplete"}
    body = kinds[2:-1]
    assert body[:2] == ["response.output_item.added", "response.content_part.added"]
    assert body[-3:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert set(body[2:-3]) <= {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    seg = only_segment(tiny_gw.session(s["id"]))
    [(start, end)] = seg["turn_spans"]
    decoded = tokenizer_of(tiny_model).decode(seg["tokens"][start:end], skip_special_tokens=True)
    assert streamed == final.output_text == decoded
    assert seg["completion_ids"] == [final.id]


def test_streamed_function_call_keeps_its_ids_and_continues_the_segment(
    scripted_gw: GatewayHandle,
) -> None:
    s = scripted_gw.new_session()
    kw: dict[str, Any] = {"model": "scripted", "tools": [ADD], "temperature": 0}
    with client_of(s) as client:
        with client.responses.stream(input=QUESTION, **kw) as st:
            events = list(st)
            final = st.get_final_response()
        call = call_of(final)
        added = [e for e in events if e.type == "response.output_item.added"]
        done = [e for e in events if e.type == "response.output_item.done"]
        assert [e.item.id for e in added] == [e.item.id for e in done] == [call.id]
        args = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert [a.arguments for a in args] == [call.arguments] == ['{"a": 2, "b": 3}']
        output = [{"type": "function_call_output", "call_id": call.call_id, "output": "5"}]
        r2 = client.responses.create(previous_response_id=final.id, input=output, **kw)
    assert r2.output_text == ANSWER
    assert only_segment(scripted_gw.session(s["id"]))["completion_ids"] == [final.id, r2.id]


# -- what agent harnesses send ------------------------------------------------------------------


def test_tools_the_model_cannot_call_are_left_out_and_named_in_a_header(
    scripted_gw: GatewayHandle, scripted_dir: Path
) -> None:
    s = scripted_gw.new_session()
    tools: list[Any] = [
        {"type": "web_search"},
        {"type": "namespace", "name": "math", "tools": [{**ADD, "strict": True}]},
    ]
    with client_of(s) as client:
        raw = client.responses.with_raw_response.create(
            model="scripted",
            input=QUESTION,
            tools=tools,
            temperature=0,
            prompt_cache_key="k",
            reasoning={"summary": "auto"},
            include=["reasoning.encrypted_content"],
            extra_body={"client_metadata": {"harness": "test"}},
        )
    assert raw.headers["x-rlgateway-tools-left-out"] == "web_search"
    assert call_of(raw.parse()).name == "add"
    assert raw.parse().reasoning is not None
    assert raw.parse().reasoning.summary == "auto"  # the request's settings, echoed
    seg = only_segment(scripted_gw.session(s["id"]))
    start = seg["turn_spans"][0][0]
    assert seg["tokens"][:start] == rendered(
        scripted_dir, [{"role": "user", "content": QUESTION}], TOOLS
    )


def test_bad_requests_are_clear_400s_and_record_nothing(scripted_gw: GatewayHandle) -> None:
    s = scripted_gw.new_session()
    other = scripted_gw.new_session()
    bad: list[tuple[dict[str, Any], str]] = [
        ({"input": [{"role": "robot", "content": "hi"}]}, "input.0.role"),
        (
            {"input": [{"type": "function_call_output", "call_id": "c", "output": "5"}]},
            "input.0.call_id",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input.0.content.0",
        ),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
        ({"input": []}, "input"),
        ({"input": "hi", "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ]
    with client_of(s) as client:
        for body, param in bad:
            with pytest.raises(openai.BadRequestError) as err:
                client.responses.create(model="scripted", **body)
            assert err.value.param == param, (body, err.value.body)
        with client_of(other) as theirs:
            r = theirs.responses.create(model="scripted", input="hi", max_output_tokens=2)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(r.id)  # another session's
        with pytest.raises(openai.NotFoundError):
            client.responses.create(model="scripted", previous_response_id=r.id, input="hi")
    assert scripted_gw.session(s["id"])["segments"] == []
    # the admin sees every kept response
    got = httpx.get(f"{scripted_gw.url}/v1/responses/{r.id}", headers=scripted_gw.admin_headers)
    assert got.status_code == 200
    assert got.json()["id"] == r.id


# -- the OpenAI Agents SDK ----------------------------------------------------------------------


async def test_openai_agents_sdk_runs_a_tool_using_agent_on_its_default_responses_model(
    scripted_gw: GatewayHandle,
) -> None:
    from agents import (
        Agent,
        FunctionTool,
        ModelSettings,
        OpenAIResponsesModel,
        RunContextWrapper,
        Runner,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    calls: list[str] = []

    async def add(ctx: RunContextWrapper[Any], arguments: str) -> str:
        calls.append(arguments)
        return "5"

    tool = FunctionTool(
        name="add",
        description=None,  # type: ignore[arg-type]
        params_json_schema=TOOLS[0]["function"]["parameters"],
        on_invoke_tool=add,
        strict_json_schema=False,
    )
    s = scripted_gw.new_session()
    client = openai.AsyncOpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
    agent = Agent(
        name="adder",
        tools=[tool],
        model=OpenAIResponsesModel(model="scripted", openai_client=client),
        model_settings=ModelSettings(temperature=0),
    )
    result = await Runner.run(agent, QUESTION)
    await client.close()
    assert calls == ['{"a": 2, "b": 3}']
    assert result.final_output == ANSWER
    seg = only_segment(scripted_gw.session(s["id"]))
    assert len(seg["completion_ids"]) == 2
    check_segment(seg)
