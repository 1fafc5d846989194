"""What the gateway does with replies whose shape must be exactly known, on every protocol: an
engine replays a fixed reply (`tests/support/replay_engine.py`) behind the real gateway
(in-process over ASGI, SQLite), so the model's text is given and only the gateway is tested.

- Two tool calls come back as two calls; with one call allowed (`parallel_tool_calls: false`,
  Anthropic's `disable_parallel_tool_use`) the reply stops at the end of the first, so the
  second is never sampled, let alone trained.
- A malformed call stays text, with its finish reason: nothing the model wrote is dropped.
- Streamed under `auto`, calls come whole in the last chunk (only the end decides them).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from engines.tiny_model import load_tokenizer
from gateway.deps import Components
from gateway.settings import GatewaySettings
from rlgateway.app import create_app
from store import Store
from tests.support.replay_engine import ReplayEngine

ADMIN = {"Authorization": "Bearer admin-token"}
ADD = {"type": "object", "properties": {"a": {}, "b": {}}}
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
TWO_CALLS = f"{CALL}\n{CALL}"
MALFORMED = '<tool_call>\n{"name": "add", "arguments": {"a": 2,\n</tool_call>'
USER = [{"role": "user", "content": "What is 2 plus 3?"}]
BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": (
        "chat/completions",
        {
            "messages": USER,
            "tools": [{"type": "function", "function": {"name": "add", "parameters": ADD}}],
        },
    ),
    "responses": (
        "responses",
        {"input": USER, "tools": [{"type": "function", "name": "add", "parameters": ADD}]},
    ),
    "messages": (
        "messages",
        {"messages": USER, "tools": [{"name": "add", "input_schema": ADD}], "max_tokens": 200},
    ),
}
ONE_CALL = {
    "chat": {"parallel_tool_calls": False},
    "responses": {"parallel_tool_calls": False},
    "messages": {"tool_choice": {"type": "auto", "disable_parallel_tool_use": True}},
}


@asynccontextmanager
async def gateway(tiny_model: Path, tmp_path: Path, reply: str) -> AsyncIterator[httpx.AsyncClient]:
    tok = load_tokenizer(tiny_model)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    engine = ReplayEngine([*tok.encode(reply, add_special_tokens=False), eos], eos)
    store = await Store.connect(f"sqlite:///{tmp_path / 'gw.db'}")
    components = Components(engine, store, tok, engine.eos_token_ids, "tiny")  # type: ignore[arg-type]
    app = create_app(GatewaySettings(admin_token="admin-token"), components)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            yield http
    await store.close()


async def ask(http: httpx.AsyncClient, protocol: str, **extra: Any) -> tuple[Any, dict[str, Any]]:
    """A session's one turn by `protocol`: its answer and the recorded session."""
    run = await http.post("/runs", json={"name": "t"}, headers=ADMIN)
    made = await http.post(f"/runs/{run.json()['id']}/sessions", json={"count": 1}, headers=ADMIN)
    s = made.json()["sessions"][0]
    path, body = BODIES[protocol]
    r = await http.post(
        f"/sessions/{s['id']}/v1/{path}",
        json=body | extra,
        headers={"Authorization": f"Bearer {s['api_key']}"},
    )
    assert r.status_code == 200, r.text
    detail = await http.get(f"/sessions/{s['id']}", headers=ADMIN)
    return r.json(), detail.json()


def calls_of(protocol: str, answer: Any) -> list[dict[str, Any]]:
    """(name, arguments) of each call in the answer."""
    if protocol == "chat":
        calls = answer["choices"][0]["message"].get("tool_calls") or []
        return [{c["function"]["name"]: json.loads(c["function"]["arguments"])} for c in calls]
    if protocol == "responses":
        out = [o for o in answer["output"] if o["type"] == "function_call"]
        return [{o["name"]: json.loads(o["arguments"])} for o in out]
    return [{b["name"]: b["input"]} for b in answer["content"] if b["type"] == "tool_use"]


def text_of(protocol: str, answer: Any) -> str:
    if protocol == "chat":
        text: str = answer["choices"][0]["message"]["content"]
        return text
    if protocol == "responses":
        [message] = [o for o in answer["output"] if o["type"] == "message"]
        return str(message["content"][0]["text"])
    [block] = [b for b in answer["content"] if b["type"] == "text"]
    return str(block["text"])


def finish_of(protocol: str, answer: Any) -> str:
    if protocol == "chat":
        return str(answer["choices"][0]["finish_reason"])
    return str(answer["status" if protocol == "responses" else "stop_reason"])


@pytest.mark.parametrize("protocol", list(BODIES))
async def test_one_call_allowed_stops_the_reply_at_the_end_of_the_first(
    tiny_model: Path, tmp_path: Path, protocol: str
) -> None:
    tok = load_tokenizer(tiny_model)
    async with gateway(tiny_model, tmp_path, TWO_CALLS) as http:
        both, both_detail = await ask(http, protocol)
        one, one_detail = await ask(http, protocol, **ONE_CALL[protocol])
    add = {"add": {"a": 2, "b": 3}}
    assert calls_of(protocol, both) == [add, add]
    assert calls_of(protocol, one) == [add]
    [(start, end)] = one_detail["segments"][0]["turn_spans"]
    sampled = tok.decode(one_detail["segments"][0]["tokens"][start:end], skip_special_tokens=True)
    assert sampled == CALL  # nothing after the first call was sampled
    [(start, end)] = both_detail["segments"][0]["turn_spans"]
    assert (
        tok.decode(both_detail["segments"][0]["tokens"][start:end], skip_special_tokens=True)
        == TWO_CALLS
    )
    stop = {"chat": "tool_calls", "responses": "completed", "messages": "tool_use"}[protocol]
    assert finish_of(protocol, both) == finish_of(protocol, one) == stop


@pytest.mark.parametrize("protocol", list(BODIES))
async def test_a_malformed_call_stays_text_with_its_finish_reason(
    tiny_model: Path, tmp_path: Path, protocol: str
) -> None:
    async with gateway(tiny_model, tmp_path, MALFORMED) as http:
        answer, _ = await ask(http, protocol)
    assert calls_of(protocol, answer) == []
    assert text_of(protocol, answer) == MALFORMED
    stop = {"chat": "stop", "responses": "completed", "messages": "end_turn"}[protocol]
    assert finish_of(protocol, answer) == stop


async def streamed_chat(tiny_model: Path, tmp_path: Path, reply: str) -> list[dict[str, Any]]:
    """The chunks of a streamed chat turn whose model says `reply`, under `tool_choice: auto`."""
    async with gateway(tiny_model, tmp_path, reply) as http:
        run = await http.post("/runs", json={"name": "t"}, headers=ADMIN)
        path = f"/runs/{run.json()['id']}/sessions"
        s = (await http.post(path, json={"count": 1}, headers=ADMIN)).json()["sessions"][0]
        r = await http.post(
            f"/sessions/{s['id']}/v1/chat/completions",
            json=BODIES["chat"][1] | {"stream": True},
            headers={"Authorization": f"Bearer {s['api_key']}"},
        )
    assert r.status_code == 200, r.text
    lines = [line.removeprefix("data: ") for line in r.text.splitlines()]
    return [json.loads(line) for line in lines if line.startswith("{")]


async def test_under_auto_streamed_calls_come_whole_at_the_end(
    tiny_model: Path, tmp_path: Path
) -> None:
    """A reply's calls are decided when it ends: two calls come in the last chunk, never before,
    and a malformed one never comes as a call at all (it is the reply's text). A call forced by
    a grammar streams as it is sampled instead (`test_forced_tool_calls.py`)."""
    chunks = await streamed_chat(tiny_model, tmp_path, TWO_CALLS)
    carrying = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("tool_calls")]
    assert [c["choices"][0]["finish_reason"] for c in carrying] == ["tool_calls"]
    assert len(carrying[0]["choices"][0]["delta"]["tool_calls"]) == 2
    chunks = await streamed_chat(tiny_model, tmp_path, MALFORMED)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert not any(d.get("tool_calls") for d in deltas)
    assert "".join(d.get("content") or "" for d in deltas) == MALFORMED
