"""Agent CLIs at the edge of the model's context, through a real `rlgateway serve` on the tiny
model (2,048 positions): a reply that the context, not the client's own limit, cut is answered
in the form each client acts on. On the Responses API (Codex) it is `context_length_exceeded`,
a 400 or, streamed, `response.failed`, on which Codex compacts its history; the turn is recorded
aborted, so a reply the client never took is never trained. On Messages (Claude Code) it is
Anthropic's `stop_reason: model_context_window_exceeded`. A reply cut by the client's own limit
stays `incomplete` / `max_tokens`."""

from __future__ import annotations

import sqlite3
from typing import Any

import anthropic
import openai
import pytest

from tests.support.gateway_server import GatewayHandle
from tests.support.openai_clients import sync_client

pytestmark = pytest.mark.slow

LONG = " a" * 1000
"""About 2,010 of the tiny model's 2,048 positions: room for a few dozen tokens of reply."""
TO_THE_END = {"ignore_eos": True}
"""Every reply runs until something cuts it."""


def trained_tokens(gw: GatewayHandle, session_id: str) -> int:
    return sum(sum(seg["loss_mask"]) for seg in gw.session(session_id)["segments"])


def test_responses_answers_context_length_exceeded_and_trains_nothing(
    tiny_gw: GatewayHandle,
) -> None:
    gw = tiny_gw
    s = gw.new_session()
    with sync_client(s, max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as bad:
            client.responses.create(model="tiny", input=LONG, extra_body=TO_THE_END)
        assert bad.value.code == "context_length_exceeded"
        events = list(
            client.responses.create(model="tiny", input=LONG, stream=True, extra_body=TO_THE_END)
        )
        kinds = [e.type for e in events]
        assert kinds[-1] == "response.failed"
        failed: Any = events[-1]
        assert failed.response.error.code == "context_length_exceeded"
        # the client's own limit, inside the room: an ordinary incomplete reply, trained
        r = client.responses.create(
            model="tiny", input=LONG, max_output_tokens=4, extra_body=TO_THE_END
        )
        assert r.status == "incomplete"
        assert r.incomplete_details is not None
        assert r.incomplete_details.reason == "max_output_tokens"
    assert trained_tokens(gw, s["id"]) == 4  # the two cut replies are recorded, never trained
    # each repeat of the request took the place of the reply the client never got: the segment
    # holds its remaining turns exactly, the replaced ones are kept outside it
    with sqlite3.connect(gw.database_url.removeprefix("sqlite:///")) as db:
        rows = db.execute(
            "SELECT c.status, s.length, length(c.prompt_delta) / 4 + length(c.output_ids) / 4 "
            "FROM completions c JOIN segments s ON s.id = c.segment_id WHERE s.session_id = ? "
            "ORDER BY c.turn",
            (s["id"],),
        ).fetchall()
    assert [status for status, _, _ in rows] == ["replaced", "replaced", "ok"]
    [(_, length, held)] = [row for row in rows if row[0] != "replaced"]
    assert length == held


def test_messages_says_the_context_window_ended_the_reply(tiny_gw: GatewayHandle) -> None:
    gw = tiny_gw
    s = gw.new_session()
    client = anthropic.Anthropic(
        base_url=s["base_url"].removesuffix("/v1"), api_key=s["api_key"], max_retries=0
    )
    ask: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": LONG}],
        "extra_body": TO_THE_END,
    }
    m = client.messages.create(max_tokens=4096, **ask)
    assert m.stop_reason == "model_context_window_exceeded"
    assert m.usage.input_tokens + m.usage.output_tokens == 2048
    small = client.messages.create(max_tokens=4, **ask)
    assert small.stop_reason == "max_tokens"
    assert trained_tokens(gw, s["id"]) == m.usage.output_tokens + 4


def test_chat_completions_keep_length(tiny_gw: GatewayHandle) -> None:
    """Chat has no such error in OpenAI's API: a reply the context cut is `length`, as vLLM's."""
    gw = tiny_gw
    s = gw.new_session()
    with sync_client(s, max_retries=0) as client:
        r = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": LONG}], extra_body=TO_THE_END
        )
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None
    assert r.usage.total_tokens == 2048
