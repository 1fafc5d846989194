"""The official `anthropic` SDK against a real `rlgateway serve`: Anthropic's Messages API
(`/v1/messages`, `.../v1/messages/count_tokens`) on the same turn core as chat completions.

The scripted model (greedy decoding calls the `add` tool, then answers "The sum is 5.") proves
tool use and its recording; the random tiny model proves the recorded logprobs and the streamed
text; a tiny model with a 16k context takes what Claude Code sends. Every test reads the session
back and checks what was recorded.
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import anthropic
import httpx
import openai
import pytest
from anthropic.types import Message, TextBlock, ToolUseBlock

from tests.support.gateway_server import GatewayHandle, serve
from tests.support.recording import (
    check_segment,
    check_teacher_forced,
    only_segment,
    tokenizer_of,
)
from tests.support.scripted_model import ANSWER, QUESTIONS, TOOLS

pytestmark = pytest.mark.slow

CALL_ARGS = {"a": 2, "b": 3}
ADD_TOOL: Any = {"name": "add", "input_schema": cast(Any, TOOLS[0])["function"]["parameters"]}
SCRIPTED: dict[str, Any] = {
    "model": "scripted",
    "max_tokens": 64,
    "tools": [ADD_TOOL],
    "extra_body": {"temperature": 0},  # greedy: the model follows its script
}
QUESTION: list[Any] = [{"role": "user", "content": QUESTIONS[0]}]
TINY_CONTEXT, LONG_CONTEXT = 2048, 16384
END_TOKENS = ("<|im_end|>", "<|endoftext|>")
RAW_EVENTS = {"message_start", "message_delta", "message_stop"} | {
    f"content_block_{k}" for k in ("start", "delta", "stop")
}


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def long_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engines.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("long") / "model", max_model_len=LONG_CONTEXT)


@pytest.fixture(scope="module")
def long_gw(long_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayHandle]:
    yield from serve(long_dir, tmp_path_factory, "gw-long")


# -- helpers ----------------------------------------------------------------------------------


def client_of(session: dict[str, Any], base_url: str | None = None) -> anthropic.Anthropic:
    base_url = base_url or session["base_url"].removesuffix("/v1")
    return anthropic.Anthropic(base_url=base_url, api_key=session["api_key"], max_retries=0)


def tool_use(m: Message) -> ToolUseBlock:
    [block] = m.content
    assert isinstance(block, ToolUseBlock), m
    return block


def text_of(m: Message) -> str:
    return "".join(b.text for b in m.content if isinstance(b, TextBlock))


def history(use: ToolUseBlock) -> list[Any]:
    """The question, the assistant's tool use, and its result: what an agent sends next."""
    result = {"type": "tool_result", "tool_use_id": use.id, "content": "5"}
    return [
        *QUESTION,
        {"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
        {"role": "user", "content": [result]},
    ]


def ask(client: anthropic.Anthropic, messages: list[Any] = QUESTION, **kw: Any) -> Message:
    m: Message = client.messages.create(**(SCRIPTED | kw), messages=messages)
    return m


def stream_of(client: anthropic.Anthropic, **kw: Any) -> tuple[list[Any], Message]:
    """The stream's documented events, in order, and its final message."""
    with client.messages.stream(**kw) as stream:
        events = [e for e in stream if e.type in RAW_EVENTS]
        return events, stream.get_final_message()


def check_event_order(events: list[Any]) -> None:
    """message_start; per block k = 0, 1, ...: start k, deltas k, stop k; message_delta; stop."""
    words = [e.type + (str(e.index) if e.type.startswith("content_block") else "") for e in events]
    block = r"content_block_start(\d+) (?:content_block_delta\1 )*content_block_stop\1 "
    grammar = f"message_start (?:{block})+message_delta message_stop "
    assert re.fullmatch(grammar, " ".join(words) + " "), words
    starts = [e.index for e in events if e.type == "content_block_start"]
    assert starts == list(range(len(starts)))


def spans_match_usage(seg: dict[str, Any], messages: list[Message]) -> None:
    assert seg["completion_ids"] == [m.id for m in messages]
    for m, (start, end) in zip(messages, seg["turn_spans"], strict=True):
        assert (m.usage.input_tokens, m.usage.output_tokens) == (start, end - start)


# -- tool use, token-exact --------------------------------------------------------------------


def test_tool_use_conversation_is_one_exact_segment(
    scripted_gw: GatewayHandle, scripted_dir: Path
) -> None:
    s = scripted_gw.new_session()
    with client_of(s) as client:
        first = ask(client)
        assert first.stop_reason == "tool_use"
        use = tool_use(first)
        assert use.id.startswith("toolu_")
        assert (use.name, use.input) == ("add", CALL_ARGS)
        messages = history(use)
        messages[1]["content"] = first.content  # the assistant content as returned
        second = ask(client, messages)
    assert (second.stop_reason, second.stop_sequence) == ("end_turn", None)
    assert [b.type for b in second.content] == ["text"]
    assert text_of(second) == ANSWER
    assert first.id.startswith("msg_")
    assert second.id != first.id

    detail = scripted_gw.session(s["id"])
    assert detail["prefix_breaks"] == 0
    seg = only_segment(detail)
    check_segment(seg)
    spans_match_usage(seg, [first, second])
    # turn 1's prompt is the chat template over the same conversation in OpenAI's form
    tok = tokenizer_of(scripted_dir)
    rendered = tok.apply_chat_template(
        QUESTION, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    start = seg["turn_spans"][0][0]
    assert seg["tokens"][:start] == tok.encode(rendered, add_special_tokens=False)


def test_recorded_logprobs_are_the_models(tiny_gw: GatewayHandle, tiny_model: Path) -> None:
    s = tiny_gw.new_session()
    messages: list[Any] = []
    replies: list[Message] = []
    with client_of(s) as client:
        for text in ["Hello there.", "Go on."]:
            messages.append({"role": "user", "content": text})
            replies.append(client.messages.create(model="tiny", max_tokens=16, messages=messages))
            messages.append({"role": "assistant", "content": replies[-1].content})
    seg = only_segment(tiny_gw.session(s["id"]))
    check_segment(seg)
    spans_match_usage(seg, replies)
    check_teacher_forced(tiny_model, seg, temperature=1.0)  # the run's default temperature


# -- streaming --------------------------------------------------------------------------------


def test_stream_events_and_text_are_the_recorded_turn(
    tiny_gw: GatewayHandle, tiny_model: Path
) -> None:
    s = tiny_gw.new_session()
    with client_of(s) as client:
        events, final = stream_of(
            client, model="tiny", max_tokens=20, messages=[{"role": "user", "content": "Go."}]
        )
    check_event_order(events)
    assert events[0].message.id == final.id
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert all(d.type == "text_delta" for d in deltas)
    assert "".join(d.text for d in deltas) == text_of(final)
    assert events[-2].usage.output_tokens == final.usage.output_tokens

    seg = only_segment(tiny_gw.session(s["id"]))
    check_segment(seg)
    spans_match_usage(seg, [final])
    [(start, end)] = seg["turn_spans"]
    tok = tokenizer_of(tiny_model)
    assert text_of(final) == tok.decode(seg["tokens"][start:end], skip_special_tokens=True)
    ended = seg["tokens"][end - 1] in {tok.convert_tokens_to_ids(t) for t in END_TOKENS}
    assert final.stop_reason == ("end_turn" if ended else "max_tokens")


def test_streamed_tool_use_assembles_into_the_same_input(scripted_gw: GatewayHandle) -> None:
    plain_session, stream_session = scripted_gw.new_sessions(2)
    with client_of(plain_session) as client:
        plain = tool_use(ask(client))
    with client_of(stream_session) as client:
        events, final = stream_of(client, **SCRIPTED, messages=QUESTION)
    check_event_order(events)
    assert final.stop_reason == "tool_use"
    assert events[-2].delta.stop_reason == "tool_use"
    streamed = tool_use(final)
    assert streamed.id.startswith("toolu_")
    assert streamed.id != plain.id
    assert (streamed.name, streamed.input) == (plain.name, plain.input) == ("add", CALL_ARGS)
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert [d.type for d in deltas] == ["input_json_delta"]  # no tool-call markup as text
    spans_match_usage(only_segment(scripted_gw.session(stream_session["id"])), [final])


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_stop_sequence_cuts_the_answer(scripted_gw: GatewayHandle, stream: bool) -> None:
    s = scripted_gw.new_session()
    with client_of(s) as client:
        first = ask(client)
        kw: dict[str, Any] = {"messages": history(tool_use(first)), "stop_sequences": ["zz", "5"]}
        if stream:
            events, m = stream_of(client, **SCRIPTED, **kw)
            check_event_order(events)
            assert events[-2].delta.stop_sequence == "5"
        else:
            m = client.messages.create(**SCRIPTED, **kw)
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "5")
    assert text_of(m) == "The sum is "
    seg = only_segment(scripted_gw.session(s["id"]))
    check_segment(seg)
    spans_match_usage(seg, [first, m])


@pytest.mark.parametrize(
    "tool_choice", [None, {"type": "tool", "name": "add"}], ids=["auto", "named"]
)
def test_count_tokens_is_the_input_of_a_fresh_request(
    scripted_gw: GatewayHandle, tool_choice: Any
) -> None:
    first, counted, fresh = scripted_gw.new_sessions(3)
    with client_of(first) as client:
        messages = history(tool_use(ask(client)))
    kw: dict[str, Any] = {"system": "You add numbers."}
    if tool_choice is not None:
        kw["tool_choice"] = tool_choice  # its forced start of the turn counts as input
    with client_of(counted) as client:
        n = client.messages.count_tokens(
            model="scripted", messages=messages, tools=[ADD_TOOL], **kw
        ).input_tokens
        bare = client.messages.count_tokens(model="scripted", messages=messages).input_tokens
    assert n > bare
    assert scripted_gw.session(counted["id"])["segments"] == []  # counting records nothing
    with client_of(fresh) as client:
        assert ask(client, messages, **kw).usage.input_tokens == n


# -- errors, in Anthropic's shape, record nothing ---------------------------------------------


def test_rejected_requests_are_anthropic_errors_and_record_nothing(
    scripted_gw: GatewayHandle,
) -> None:
    s, other = scripted_gw.new_sessions(2)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "i"}}
    bad_bodies: list[list[Any]] = [
        [{"role": "tool", "content": "x"}],
        [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x"}]}],
        [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}],
    ]

    def check_error(status: int, kind: str, exc: anthropic.APIStatusError) -> None:
        assert exc.status_code == status
        assert isinstance(exc.body, dict), exc.body
        assert exc.body["type"] == "error"
        assert exc.body["error"]["type"] == kind
        assert exc.body["error"]["message"]

    with client_of(s) as client:
        for messages in bad_bodies:
            with pytest.raises(anthropic.BadRequestError) as bad:
                ask(client, messages)
            check_error(400, "invalid_request_error", bad.value)
    with httpx.Client(timeout=30) as http:
        r = http.post(
            f"{s['base_url']}/messages",
            json={"model": "scripted", "messages": QUESTION},  # no max_tokens
            headers={"x-api-key": s["api_key"], "anthropic-version": "2023-06-01"},
        )
    assert (r.status_code, r.json()["type"]) == (400, "error")  # not FastAPI's 422
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in r.json()["error"]["message"]
    with client_of({**s, "api_key": "rlg-not-a-key"}) as client:
        with pytest.raises(anthropic.AuthenticationError) as auth:
            ask(client)
        check_error(401, "authentication_error", auth.value)
    with client_of(s, f"{scripted_gw.url}/sessions/{other['id']}") as client:
        with pytest.raises(anthropic.NotFoundError) as not_found:
            ask(client)
        check_error(404, "not_found_error", not_found.value)

    assert scripted_gw.session(s["id"])["segments"] == []
    assert scripted_gw.session(other["id"])["segments"] == []
    with client_of(s) as client:
        m = ask(client)
    assert m.stop_reason == "tool_use"
    assert only_segment(scripted_gw.session(s["id"]))["completion_ids"] == [m.id]


# -- what real harnesses send -----------------------------------------------------------------


def test_claude_code_request_is_accepted(long_gw: GatewayHandle, long_dir: Path) -> None:
    """Claude Code's request: the beta route and headers, a long cached system prompt, a dozen
    tools and a server tool, adaptive thinking, metadata, context management and a max_tokens
    beyond the model's context. Stop sequences (any letter) end the random model's turn early."""
    cached = {"cache_control": {"type": "ephemeral"}}
    system: list[Any] = [
        {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."},
        {"type": "text", "text": "Follow the rules. " * 200, **cached},
        {"type": "text", "text": "Be concise. " * 150, **cached},
    ]
    schema = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
    tools: list[Any] = [
        {"name": f"Tool{i}", "description": f"Does thing {i}. " * 4, "input_schema": schema}
        for i in range(12)
    ]
    tools.append({"type": "web_search_20250305", "name": "web_search", "max_uses": 5})
    text = [{"type": "text", "text": "<system-reminder>Be careful.</system-reminder>"}]
    content = [*text, {"type": "text", "text": "hello", **cached}]
    kw: dict[str, Any] = {
        "model": "claude-sonnet-4-5-20250929",
        "system": system,
        "tools": tools,
        "messages": [{"role": "user", "content": content}],
        "metadata": {"user_id": "u"},
        "stop_sequences": list(string.ascii_letters),
    }
    s, header_session = long_gw.new_sessions(2)
    with (
        client_of(s) as client,
        client.beta.messages.stream(
            **kw,
            max_tokens=32000,
            thinking={"type": "adaptive"},
            betas=["claude-code-20250219", "interleaved-thinking-2025-05-14"],
            context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            output_config={"effort": "high"},
            extra_query={"beta": "true"},
        ) as stream,
    ):
        assert stream.response.status_code == 200
        events = [e for e in stream if e.type in RAW_EVENTS]
        final = stream.get_final_message()
    check_event_order(events)
    assert final.stop_reason in {"stop_sequence", "end_turn"}
    assert final.usage.input_tokens > 3000  # the whole system prompt and the tools
    assert final.usage.input_tokens + final.usage.output_tokens <= LONG_CONTEXT
    with client_of(header_session) as client:  # a request of its own session
        raw = client.messages.with_raw_response.create(**kw, max_tokens=64)
    assert raw.headers["x-rlgateway-tools-left-out"] == "web_search"
    assert raw.parse().usage.input_tokens == final.usage.input_tokens

    seg = only_segment(long_gw.session(s["id"]))
    check_segment(seg)
    start = seg["turn_spans"][0][0]
    prompt = tokenizer_of(long_dir).decode(seg["tokens"][:start], skip_special_tokens=False)
    assert "\n".join(b["text"] for b in system) in prompt
    assert all(f'"Tool{i}"' in prompt for i in range(12))
    assert "web_search" not in prompt


def test_max_tokens_beyond_the_context_is_capped(tiny_gw: GatewayHandle) -> None:
    s = tiny_gw.new_session()
    messages: list[Any] = [{"role": "user", "content": "x" * 1990}]
    with client_of(s) as client:
        n = client.messages.count_tokens(model="tiny", messages=messages).input_tokens
        assert TINY_CONTEXT - 64 < n < TINY_CONTEXT
        m = client.messages.create(
            model="tiny", max_tokens=8000, messages=messages, extra_body={"temperature": 0}
        )
    assert m.usage.input_tokens == n
    # greedy decoding of the random model runs on to the end of the context, and stops there:
    # the context, not max_tokens, ended it (test_context_edge.py)
    assert m.stop_reason == "model_context_window_exceeded", "the model ended its turn early"
    assert m.usage.output_tokens == TINY_CONTEXT - n
    spans_match_usage(only_segment(tiny_gw.session(s["id"])), [m])


# -- one session, any protocol ----------------------------------------------------------------


def test_openai_turn_then_anthropic_turn_is_one_segment(scripted_gw: GatewayHandle) -> None:
    s = scripted_gw.new_session()
    with openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0) as oai:
        r = oai.chat.completions.create(
            model="scripted",
            messages=QUESTION,
            tools=cast(Any, TOOLS),
            temperature=0,
            max_tokens=64,
        )
    [call] = r.choices[0].message.tool_calls or []
    assert call.type == "function"
    assert call.id.startswith("call_")
    use = ToolUseBlock(
        type="tool_use",
        id="toolu_" + call.id.removeprefix("call_"),
        name=call.function.name,
        input=json.loads(call.function.arguments),
    )
    with client_of(s) as client:
        m = ask(client, history(use))
    assert (m.stop_reason, text_of(m)) == ("end_turn", ANSWER)
    detail = scripted_gw.session(s["id"])
    assert detail["prefix_breaks"] == 0
    seg = only_segment(detail)
    check_segment(seg)
    assert seg["completion_ids"] == [r.id, m.id]


def test_a_last_assistant_message_is_continued_not_answered(
    scripted_gw: GatewayHandle, scripted_dir: Path
) -> None:
    """Anthropic's prefill: the reply continues the client's own start of it, and only what
    follows comes back; the start is part of the recorded prompt."""
    s = scripted_gw.new_session()
    with client_of(s) as client:
        use = tool_use(ask(client))
        prefilled = [*history(use), {"role": "assistant", "content": "The sum"}]
        m = ask(client, prefilled)
    assert text_of(m) == ANSWER.removeprefix("The sum")
    assert m.stop_reason == "end_turn"
    seg = only_segment(scripted_gw.session(s["id"]))
    start = seg["turn_spans"][1][0]
    prompt = tokenizer_of(scripted_dir).decode(seg["tokens"][:start], skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>assistant\nThe sum")


def test_a_system_turn_among_the_messages_is_a_system_message(
    scripted_gw: GatewayHandle, scripted_dir: Path
) -> None:
    s = scripted_gw.new_session()
    system = {"role": "system", "content": "Be brief."}
    with client_of(s) as client:
        m = client.messages.create(
            **SCRIPTED,
            messages=[*QUESTION, system, *QUESTION],  # type: ignore[list-item]
        )
    seg = only_segment(scripted_gw.session(s["id"]))
    start = seg["turn_spans"][0][0]
    prompt = tokenizer_of(scripted_dir).decode(seg["tokens"][:start], skip_special_tokens=False)
    assert "<|im_start|>system\nBe brief.<|im_end|>" in prompt
    assert m.usage.input_tokens == start
