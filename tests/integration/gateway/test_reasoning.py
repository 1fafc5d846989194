"""Reasoning on every protocol, against a real `rlgateway serve --reasoning-parser think` on the
thinking variant of the scripted model (greedy: `<think>\\nThey want a sum.\\n</think>\\n\\n`, then
the `add` call; after the tool result, the same thought, then "The sum is 5.").

The reasoning comes out as `reasoning_content` (chat completions), a `reasoning` item (Responses)
and a `thinking` block (Messages), streamed and not; it stays verbatim in the recorded tokens;
and a client that sends it back (or drops it) continues the same segment. Last, on the tiny
model with a Qwen3-like template (one that re-renders earlier turns without their reasoning), a
conversation over several user turns stays one segment.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from tests.support.gateway_server import GatewayHandle, serve
from tests.support.paths import SUPPORT
from tests.support.recording import check_segment, only_segment, tokenizer_of
from tests.support.scripted_model import ANSWER, THOUGHT, TOOLS

pytestmark = pytest.mark.slow

QUESTION = "What is 2 plus 3?"
THINK = f"<think>\n{THOUGHT}\n</think>"
GREEDY = {"temperature": 0}
ADD_ANTHROPIC = {"name": "add", "input_schema": TOOLS[0]["function"]["parameters"]}
ADD_RESPONSES = {"type": "function", "name": "add", "parameters": ADD_ANTHROPIC["input_schema"]}


@pytest.fixture(scope="module")
def thinking_dir() -> Path:
    from tests.support.scripted_model import scripted_model_dir

    return scripted_model_dir(thinking=True)


@pytest.fixture(scope="module")
def gw(thinking_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayHandle]:
    yield from serve(thinking_dir, tmp_path_factory, "gw-think", ["--reasoning-parser", "think"])


@pytest.fixture(scope="module")
def qwen3_like_gw(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayHandle]:
    """The tiny model with a template that re-renders earlier turns, as Qwen3's does
    (`tests/support/qwen3_like.jinja`)."""
    model = tmp_path_factory.mktemp("qwen3-like") / "model"
    shutil.copytree(tiny_model, model)
    shutil.copy(SUPPORT / "qwen3_like.jinja", model / "chat_template.jinja")
    yield from serve(model, tmp_path_factory, "gw-qwen3-like", ["--reasoning-parser", "think"])


def openai_client(s: dict[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)


def anthropic_client(s: dict[str, Any]) -> anthropic.Anthropic:
    base = s["base_url"].removesuffix("/v1")
    return anthropic.Anthropic(base_url=base, api_key=s["api_key"], max_retries=0)


def ask_chat(client: openai.OpenAI, messages: list[Any]) -> Any:
    return client.chat.completions.create(model="m", messages=messages, tools=TOOLS, **GREEDY)


def check_thoughts_recorded(
    gw: GatewayHandle, thinking_dir: Path, s: dict[str, Any], reasoning_tokens: int | None = None
) -> None:
    """One segment, each turn's sampled text starting with the reasoning, verbatim; the first
    turn's reasoning is `reasoning_tokens` of its tokens (those up to the end of `</think>`)."""
    seg = only_segment(gw.session(s["id"]))
    check_segment(seg)
    assert len(seg["completion_ids"]) == 2
    tok = tokenizer_of(thinking_dir)
    for start, end in seg["turn_spans"]:
        assert tok.decode(seg["tokens"][start:end]).startswith(THINK + "\n\n")
    if reasoning_tokens is not None:
        start, end = seg["turn_spans"][0]
        ends = [
            k
            for k in range(end - start + 1)
            if "</think>" in tok.decode(seg["tokens"][start : start + k])
        ]
        assert 0 < reasoning_tokens == ends[0] < end - start


def test_chat_completions_reasoning_content(gw: GatewayHandle, thinking_dir: Path) -> None:
    s = gw.new_session()
    question = [{"role": "user", "content": QUESTION}]
    with openai_client(s) as client:
        r1 = ask_chat(client, question)
        m1 = r1.choices[0].message
        assert m1.model_extra is not None
        assert m1.model_extra["reasoning_content"] == THOUGHT
        assert m1.content is None
        assert r1.choices[0].finish_reason == "tool_calls"
        assert m1.tool_calls is not None
        call = m1.tool_calls[0]
        history = [
            *question,
            m1.model_dump(exclude_none=True),  # the reasoning goes back with the call
            {"role": "tool", "tool_call_id": call.id, "content": "5"},
        ]
        stream = client.chat.completions.create(
            model="m",
            messages=history,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            stream=True,
            **GREEDY,
        )
        thought, text = "", ""
        for chunk in stream:
            delta = chunk.choices[0].delta
            thought += (delta.model_extra or {}).get("reasoning_content") or ""
            text += delta.content or ""
    assert (thought, text) == (THOUGHT, ANSWER)
    assert r1.usage is not None
    assert r1.usage.completion_tokens_details is not None
    check_thoughts_recorded(
        gw, thinking_dir, s, r1.usage.completion_tokens_details.reasoning_tokens
    )


def test_responses_reasoning_items_and_their_sealed_content(
    gw: GatewayHandle, thinking_dir: Path
) -> None:
    s = gw.new_session()
    kw: dict[str, Any] = {
        "model": "m",
        "tools": [ADD_RESPONSES],
        "store": False,
        "include": ["reasoning.encrypted_content"],
        **GREEDY,
    }
    with openai_client(s) as client:
        r1 = client.responses.create(input=QUESTION, **kw)
        kinds = [o.type for o in r1.output]
        assert kinds == ["reasoning", "function_call"]
        reasoning = r1.output[0]
        assert reasoning.type == "reasoning"
        assert reasoning.content is not None
        assert reasoning.content[0].text == THOUGHT
        assert reasoning.encrypted_content
        call = r1.output[1]
        assert call.type == "function_call"
        # the client sends back only what it must: the sealed reasoning, no text of it
        sealed = {"type": "reasoning", "id": reasoning.id, "summary": []}
        sealed["encrypted_content"] = reasoning.encrypted_content
        history = [
            {"role": "user", "content": QUESTION},
            sealed,
            call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "5"},
        ]
        with client.responses.stream(input=history, **kw) as st:
            events = list(st)
            final = st.get_final_response()
    kinds = [e.type for e in events]
    first_text = kinds.index("response.output_text.delta")
    assert kinds.index("response.reasoning_text.delta") < first_text
    assert kinds.index("response.reasoning_text.done") < first_text
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed == THOUGHT
    assert [o.type for o in final.output] == ["reasoning", "message"]
    assert final.output_text == ANSWER
    assert r1.usage is not None
    assert final.usage is not None
    assert final.usage.output_tokens_details.reasoning_tokens > 0  # the streamed one's too
    check_thoughts_recorded(gw, thinking_dir, s, r1.usage.output_tokens_details.reasoning_tokens)


def test_messages_thinking_blocks(gw: GatewayHandle, thinking_dir: Path) -> None:
    s = gw.new_session()
    kw: dict[str, Any] = {
        "model": "m",
        "max_tokens": 200,
        "tools": [ADD_ANTHROPIC],
        "extra_body": GREEDY,
    }
    question = {"role": "user", "content": QUESTION}
    with anthropic_client(s) as client:
        r1 = client.messages.create(messages=[question], **kw)
        assert [b.type for b in r1.content] == ["thinking", "tool_use"]
        thinking, use = r1.content
        assert thinking.type == "thinking"
        assert thinking.thinking == THOUGHT
        assert thinking.signature
        assert use.type == "tool_use"
        assert r1.stop_reason == "tool_use"
        result = {"type": "tool_result", "tool_use_id": use.id, "content": "5"}
        history = [
            question,
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r1.content]},
            {"role": "user", "content": [result]},
        ]
        with client.messages.stream(messages=history, **kw) as st:  # type: ignore[arg-type]
            events = list(st)
            final = st.get_final_message()
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == THOUGHT
    assert [d.type for d in deltas if d.type == "signature_delta"] == ["signature_delta"]
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[1].text == ANSWER  # type: ignore[union-attr]
    check_thoughts_recorded(gw, thinking_dir, s)


def test_a_history_without_the_reasoning_still_continues_the_segment(
    gw: GatewayHandle, thinking_dir: Path
) -> None:
    """Most chat clients drop `reasoning_content` when they send the history back: the exact
    tokens are in the segment all the same."""
    s = gw.new_session()
    question = [{"role": "user", "content": QUESTION}]
    with openai_client(s) as client:
        r1 = ask_chat(client, question)
        m1 = r1.choices[0].message
        assert m1.tool_calls is not None
        echoed = {"role": "assistant", "content": None, "tool_calls": m1.model_dump()["tool_calls"]}
        tool = {"role": "tool", "tool_call_id": m1.tool_calls[0].id, "content": "5"}
        r2 = client.chat.completions.create(
            model="m",
            messages=[*question, echoed, tool],  # type: ignore[list-item]
            tools=TOOLS,  # type: ignore[arg-type]
            **GREEDY,
        )
    assert r2.choices[0].message.content == ANSWER
    check_thoughts_recorded(gw, thinking_dir, s)


def test_a_template_that_rerenders_earlier_turns_keeps_a_conversation_one_segment(
    qwen3_like_gw: GatewayHandle,
) -> None:
    """Qwen3's template drops an earlier turn's reasoning once a new user message follows, so
    rendering is not append-only there: the conversation still continues its one segment, its
    earlier turns' tokens exactly as sampled."""
    gw = qwen3_like_gw
    s = gw.new_session()
    messages: list[dict[str, Any]] = []
    with openai_client(s) as client:
        for k, text in enumerate(["Hello.", "Go on.", "And then?"]):
            messages.append({"role": "user", "content": text})
            r = client.chat.completions.create(
                model="m",
                messages=messages,
                max_tokens=8,
                seed=k,  # type: ignore[arg-type]
            )
            messages.append(r.choices[0].message.model_dump(exclude_none=True))
    detail = gw.session(s["id"])
    assert detail["prefix_breaks"] == 0
    seg = only_segment(detail)
    check_segment(seg)
    assert len(seg["completion_ids"]) == 3
