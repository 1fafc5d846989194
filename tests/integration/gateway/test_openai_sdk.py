"""The official `openai` SDK (sync and async, streaming and not) against a real `rlgateway serve`
on the random tiny model (arbitrary bytes, often invalid UTF-8); tools on the scripted model are
test_openai_sdk_tools.py. Besides what the SDK sees, every test reads the session back
(`GET /sessions/{id}`) and checks what was recorded: token-exact segments whose sampled tokens and
logprobs are what the engine produced, which greedy replay from the recorded prompt and a
teacher-forced forward pass confirm.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from tests.support.gateway_server import GatewayHandle
from tests.support.openai_clients import async_client, completion_id, sync_client, user, wait_for
from tests.support.recording import (
    check_segment,
    check_teacher_forced,
    only_segment,
    tokenizer_of,
)

pytestmark = pytest.mark.slow

CALL_ARGS = {"a": 2, "b": 3}
TINY_CONTEXT = 2048


# -- plain chat: the response, its logprobs and usage are what was recorded ---------------------


def test_sync_chat_response_and_logprobs_match_the_recording(tiny_gw: GatewayHandle) -> None:
    s = tiny_gw.new_session()
    with sync_client(s) as client:
        r = client.chat.completions.create(
            model="my-policy",  # any name: the gateway serves its one model, echoing the name
            messages=[user("Tell me something.")],
            max_tokens=12,
            seed=7,
            logprobs=True,
            top_logprobs=3,
        )
    assert isinstance(r, ChatCompletion)
    assert r.object == "chat.completion"
    assert r.model == "my-policy"
    assert r.id.startswith("chatcmpl-")
    assert len(r.choices) == 1
    choice = r.choices[0]
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert choice.finish_reason in {"stop", "length"}
    assert completion_id(choice) == r.id  # n == 1: the turn's id is the response id

    seg = only_segment(tiny_gw.session(s["id"]))
    check_segment(seg)
    assert seg["completion_ids"] == [r.id]
    [(start, end)] = seg["turn_spans"]
    assert end == len(seg["tokens"])
    assert r.usage is not None
    assert r.usage.prompt_tokens == start
    assert r.usage.completion_tokens == end - start
    assert r.usage.total_tokens == end

    assert choice.logprobs is not None
    assert choice.logprobs.content is not None
    entries = choice.logprobs.content
    assert len(entries) == end - start
    for entry, recorded in zip(entries, seg["logprobs"][start:end], strict=True):
        assert entry.logprob == pytest.approx(recorded, abs=1e-6)
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3
        assert tops == sorted(tops, reverse=True)
        assert entry.logprob <= tops[0] + 1e-6  # nothing is likelier than the likeliest


def test_logprob_bytes_are_the_raw_bytes_of_each_token(
    tiny_gw: GatewayHandle, tiny_model: Path
) -> None:
    """OpenAI's `bytes` let a client rebuild text that tokens split mid-character. The tiny model's
    token id is its byte value, so the bytes of a sampled token t < 256 must be [t] — not the
    UTF-8 of U+FFFD that decoding a lone invalid byte gives."""
    s = tiny_gw.new_session()
    with sync_client(s) as client:
        r = client.chat.completions.create(
            model="tiny",
            messages=[user("bytes")],
            max_tokens=24,
            seed=3,
            logprobs=True,
            extra_body={"ignore_eos": True},
        )
    seg = only_segment(tiny_gw.session(s["id"]))
    [(start, end)] = seg["turn_spans"]
    sampled = seg["tokens"][start:end]
    assert any(t >= 0x80 and t < 256 for t in sampled), "no non-ASCII byte sampled: pick a seed"
    tok = tokenizer_of(tiny_model)
    expected = [
        [t] if t < 256 else list(tok.decode([t], skip_special_tokens=False).encode())
        for t in sampled
    ]
    logprobs = r.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.content is not None
    content = logprobs.content
    assert [e.bytes for e in content] == expected


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_reply_text_is_the_decoded_sampled_tokens(
    tiny_gw: GatewayHandle, tiny_model: Path, stream: bool
) -> None:
    """The reply is the text of every sampled token, even when the last ones are bytes that do
    not form a character (decoded as U+FFFD, as the tokenizer does), streamed or not."""
    s = tiny_gw.new_session()
    kw: dict[str, Any] = {"model": "tiny", "messages": [user("x")], "max_tokens": 6, "seed": 0}
    async with async_client(s) as client:
        if stream:
            chunks = await client.chat.completions.create(**kw, stream=True)
            async with chunks:
                text = "".join(
                    [c.choices[0].delta.content or "" async for c in chunks if c.choices]
                )
        else:
            r = await client.chat.completions.create(**kw)
            text = r.choices[0].message.content or ""
    seg = only_segment(tiny_gw.session(s["id"]))
    [(start, end)] = seg["turn_spans"]
    decoded = tokenizer_of(tiny_model).decode(seg["tokens"][start:end], skip_special_tokens=True)
    assert decoded.endswith("\ufffd"), "the reply ends in a whole character: pick another seed"
    assert text == decoded


async def test_async_stream_matches_non_stream_and_is_recorded(tiny_gw: GatewayHandle) -> None:
    messages = [user("Stream this, please.")]
    kw: dict[str, Any] = {
        "model": "tiny",
        "messages": messages,
        "max_tokens": 20,
        "seed": 5,
        "logprobs": True,
    }
    plain_session, stream_session = tiny_gw.new_sessions(2)
    async with async_client(plain_session) as client:
        plain = await client.chat.completions.create(**kw)
    async with async_client(stream_session) as client:
        stream = await client.chat.completions.create(
            **kw, stream=True, stream_options={"include_usage": True}
        )
        chunks: list[ChatCompletionChunk] = []
        async with stream:
            async for chunk in stream:
                chunks.append(chunk)
        # the stream has ended: its turn is in the store already
        detail = tiny_gw.session(stream_session["id"])

    assert all(isinstance(c, ChatCompletionChunk) for c in chunks)
    assert len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == plain.choices[0].finish_reason
    assert all(f is None for f in finishes[:-1])
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    assert plain.usage is not None
    assert last.usage.model_dump() == plain.usage.model_dump()
    streamed_logprobs = [
        e.logprob
        for c in chunks
        if c.choices and c.choices[0].logprobs is not None
        for e in c.choices[0].logprobs.content or []
    ]
    plain_logprobs = plain.choices[0].logprobs
    assert plain_logprobs is not None
    assert plain_logprobs.content is not None
    assert streamed_logprobs == [e.logprob for e in plain_logprobs.content]

    seg = only_segment(detail)
    check_segment(seg)
    assert seg["completion_ids"] == [chunks[0].id]
    [(start, end)] = seg["turn_spans"]
    assert (start, end - start) == (last.usage.prompt_tokens, last.usage.completion_tokens)
    assert detail["finish_reasons"] == {chunks[0].id: finishes[-1]}
    # the same seed sampled the same tokens in both sessions
    plain_seg = only_segment(tiny_gw.session(plain_session["id"]))
    assert plain_seg["tokens"] == seg["tokens"]


# -- n choices ----------------------------------------------------------------------------------


def test_n_choices_are_separate_segments_and_reproduce_with_a_seed(tiny_gw: GatewayHandle) -> None:
    texts = []
    for s in tiny_gw.new_sessions(2):
        with sync_client(s) as client:
            r = client.chat.completions.create(
                model="tiny", messages=[user("three ways")], n=3, seed=11, max_tokens=10
            )
        assert [c.index for c in r.choices] == [0, 1, 2]
        ids = [completion_id(c) for c in r.choices]
        assert ids == [f"{r.id}-{i}" for i in range(3)]
        texts.append([c.message.content for c in r.choices])

        detail = tiny_gw.session(s["id"])
        assert detail["prefix_breaks"] == 0
        segments = detail["segments"]
        assert len(segments) == 3
        assert sorted(cid for seg in segments for cid in seg["completion_ids"]) == ids
        assert r.usage is not None
        sampled = 0
        for seg in segments:
            check_segment(seg)
            [(start, end)] = seg["turn_spans"]
            assert start == r.usage.prompt_tokens  # every choice saw the same prompt
            sampled += end - start
        assert sampled == r.usage.completion_tokens
        assert len({tuple(seg["tokens"]) for seg in segments}) == 3
    assert texts[0] == texts[1]
    assert len(set(texts[0])) > 1


# -- the random model: text is never re-tokenized ---------------------------------------------


def test_invalid_utf8_replies_extend_the_segment_token_exactly(
    tiny_gw: GatewayHandle, tiny_model: Path
) -> None:
    s = tiny_gw.new_session()
    messages: list[dict[str, Any]] = []
    replies: list[str] = []
    with sync_client(s) as client:
        for k, text in enumerate(["Hello there.", "Go on.", "And then?"]):
            messages.append(user(text))
            r = client.chat.completions.create(
                model="tiny", messages=messages, temperature=1.0, seed=100 + k, max_tokens=24
            )
            messages.append(r.choices[0].message.model_dump())
            replies.append(r.choices[0].message.content or "")
    assert any("\ufffd" in reply for reply in replies), replies

    detail = tiny_gw.session(s["id"])
    assert detail["prefix_breaks"] == 0
    seg = only_segment(detail)
    assert len(seg["completion_ids"]) == 3
    check_segment(seg)
    check_teacher_forced(tiny_model, seg, temperature=1.0)

    tok = tokenizer_of(tiny_model)
    eos = {tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
    mismatched = 0
    for reply, (start, end) in zip(replies, seg["turn_spans"], strict=True):
        sampled = [t for t in seg["tokens"][start:end] if t not in eos]
        if tok.encode(reply, add_special_tokens=False) != sampled:
            mismatched += 1
    assert mismatched >= 1, "every reply re-encodes to its tokens: this test proves nothing"


def test_edited_history_opens_a_new_segment(tiny_gw: GatewayHandle) -> None:
    s = tiny_gw.new_session()
    kw: dict[str, Any] = {"model": "tiny", "max_tokens": 4, "seed": 1}
    with sync_client(s) as client:
        first = [user("The first question.")]
        r1 = client.chat.completions.create(messages=first, **kw)
        history = [*first, r1.choices[0].message.model_dump(), user("A follow-up.")]
        r2 = client.chat.completions.create(messages=history, **kw)
        assert tiny_gw.session(s["id"])["prefix_breaks"] == 0
        edited = [user("The first question, edited."), *history[1:]]
        r3 = client.chat.completions.create(messages=edited, **kw)
    detail = tiny_gw.session(s["id"])
    assert detail["prefix_breaks"] == 1
    assert [seg["completion_ids"] for seg in detail["segments"]] == [[r1.id, r2.id], [r3.id]]
    for seg in detail["segments"]:
        check_segment(seg)


# -- a client that goes away mid-stream ---------------------------------------------------------


@pytest.mark.parametrize("route", ["chat/completions", "completions"])
def test_disconnected_stream_is_recorded_as_aborted(tiny_gw: GatewayHandle, route: str) -> None:
    """The client reads a few chunks and hangs up: the turn is committed with what was sampled
    until then, finish_reason "abort" (nothing generated is lost)."""
    s = tiny_gw.new_session()
    body: dict[str, Any] = {"model": "tiny", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    if route == "completions":
        body["prompt"] = "Talk forever."
    else:
        body["messages"] = [user("Talk forever.")]
    headers = {"Authorization": f"Bearer {s['api_key']}"}
    url = f"{tiny_gw.url}/sessions/{s['id']}/v1/{route}"
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", url, json=body, headers=headers) as resp,
    ):
        assert resp.status_code == 200
        lines = []
        for line in resp.iter_lines():
            if line:
                lines.append(line)
            if len(lines) == 3:
                break
    assert all(line.startswith("data: {") for line in lines)

    detail = wait_for(lambda: (d := tiny_gw.session(s["id"]))["finish_reasons"] and d)
    assert detail, "the aborted turn was never recorded"
    [reason] = detail["finish_reasons"].values()
    assert reason == "abort"
    seg = only_segment(detail)
    check_segment(seg)
    [(start, end)] = seg["turn_spans"]
    assert 1 <= end - start < 2000


# -- rewards and the end of a session -----------------------------------------------------------


def test_rewards_returns_idempotency_and_end(tiny_gw: GatewayHandle) -> None:
    run_id = tiny_gw.create_run("discounted", {"discount": 0.5})
    s = tiny_gw.new_session(run_id=run_id)
    ids = []
    messages: list[dict[str, Any]] = []
    with sync_client(s) as client:
        for k in range(3):
            messages.append(user(f"turn {k}"))
            r = client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=3, seed=k
            )
            messages.append(r.choices[0].message.model_dump())
            ids.append(completion_id(r.choices[0]))

    headers = {"Authorization": f"Bearer {s['api_key']}"}
    with httpx.Client(base_url=tiny_gw.url, headers=headers, timeout=30) as http:

        def reward(body: dict[str, Any]) -> httpx.Response:
            return http.post(f"/sessions/{s['id']}/reward", json=body)

        r = reward({"reward": 1.0, "completion_id": ids[0], "key": "t0"})
        assert r.status_code == 200
        assert r.json()["recorded"] is True
        r = reward({"reward": 1.0, "completion_id": ids[0], "key": "t0"})
        assert r.status_code == 200
        assert r.json()["recorded"] is False
        r = reward({"reward": 7.0, "completion_id": ids[0], "key": "t0"})
        assert r.status_code == 409
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert "t0" in err["message"]
        assert reward({"reward": 2.0, "completion_id": ids[2]}).json()["recorded"] is True

        end = http.post(f"/sessions/{s['id']}/end")
        assert end.status_code == 200
        assert end.json()["status"] == "ended"
        # the final reward arrives after the end (a grader that runs later)
        assert reward({"reward": 4.0, "key": "final"}).json()["recorded"] is True

        detail = http.get(f"/sessions/{s['id']}").json()
    assert detail["status"] == "ended"
    r_turn = [1.0, 0.0, 2.0 + 4.0]  # the final reward counts on the last turn
    g2 = r_turn[2]
    g1 = r_turn[1] + 0.5 * g2
    g0 = r_turn[0] + 0.5 * g1
    assert detail["returns"] == pytest.approx(dict(zip(ids, [g0, g1, g2], strict=True)))
    assert sorted(rw["reward"] for rw in detail["rewards"]) == [1.0, 2.0, 4.0]

    with sync_client(s, max_retries=0) as client, pytest.raises(openai.ConflictError) as exc:
        client.chat.completions.create(model="tiny", messages=[user("more?")], max_tokens=2)
    assert exc.value.status_code == 409
    assert "ended" in exc.value.message


# -- the rest of the SDK surface ----------------------------------------------------------------


def test_models_and_legacy_completions(tiny_gw: GatewayHandle, tiny_model: Path) -> None:
    s = tiny_gw.new_session()
    with sync_client(s) as client:
        models = client.models.list()
        assert [m.id for m in models.data] == [tiny_model.name]
        assert client.models.retrieve(tiny_model.name).id == tiny_model.name
        with pytest.raises(openai.NotFoundError, match="serves"):
            client.models.retrieve("gpt-4o")
        r = client.completions.create(model=tiny_model.name, prompt="abc", max_tokens=5, seed=2)
    assert r.object == "text_completion"
    assert len(r.choices) == 1
    assert r.usage is not None
    assert r.usage.prompt_tokens == 3
    seg = only_segment(tiny_gw.session(s["id"]))
    check_segment(seg)
    assert seg["completion_ids"] == [r.id]
    [(start, end)] = seg["turn_spans"]
    abc = tokenizer_of(tiny_model).encode("abc", add_special_tokens=False)
    assert seg["tokens"][:start] == abc
    assert end - start == r.usage.completion_tokens


def test_rejected_requests_record_nothing(tiny_gw: GatewayHandle, tiny_model: Path) -> None:
    s, other = tiny_gw.new_sessions(2)
    first = [user("Something short.")]
    with sync_client(s, max_retries=0) as client:
        r = client.chat.completions.create(model="tiny", messages=first, max_tokens=4, seed=1)
    before = tiny_gw.session(s["id"])

    wrong_key = {**s, "api_key": "rlg-not-a-key"}
    with (
        sync_client(wrong_key, max_retries=0) as client,
        pytest.raises(openai.AuthenticationError) as auth,
    ):
        client.chat.completions.create(model="tiny", messages=first, max_tokens=4)
    assert auth.value.status_code == 401

    unknown = {**s, "base_url": f"{tiny_gw.url}/sessions/sess_doesnotexist/v1"}
    with sync_client(unknown, max_retries=0) as client, pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="tiny", messages=first, max_tokens=4)

    long_messages = [user("x" * 3000)]
    tok = tokenizer_of(tiny_model)
    n_prompt = len(
        tok.encode(
            tok.apply_chat_template(long_messages, add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )
    )
    with sync_client(s, max_retries=0) as client, pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="tiny", messages=long_messages, max_tokens=4)
    assert bad.value.status_code == 400
    assert bad.value.code == "context_length_exceeded"
    assert str(n_prompt) in bad.value.message
    assert str(TINY_CONTEXT) in bad.value.message
    assert tiny_gw.session(s["id"]) == before
    assert tiny_gw.session(other["id"])["segments"] == []

    # the failed requests left the session extendable, as if they had never been made
    with sync_client(s, max_retries=0) as client:
        history = [*first, r.choices[0].message.model_dump(), user("Next.")]
        r2 = client.chat.completions.create(model="tiny", messages=history, max_tokens=4)
    after = tiny_gw.session(s["id"])
    assert after["prefix_breaks"] == 0
    assert only_segment(after)["completion_ids"] == [r.id, r2.id]
