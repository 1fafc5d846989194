"""Streams fail as streams: an engine that fails before the first token gets the client an HTTP
error (OpenAI-shaped JSON, Anthropic-shaped on Messages; not 200 and a cut connection); one that
fails after it ends the stream with its protocol's error event (an SSE error event and `[DONE]`,
`response.failed`, Anthropic's `error`), and the turn is recorded aborted with what was
generated, never trained. In-process, on a fake engine that fails on cue."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from engines.base import EngineHealth, GenerateRequest, TokenChunk, WeightUpdate
from engines.errors import EngineUnavailableError
from engines.tiny_model import load_tokenizer
from gateway.deps import Components
from gateway.settings import GatewaySettings
from rlgateway.app import create_app
from store import Store

ADMIN = {"Authorization": "Bearer admin-token"}
USER = [{"role": "user", "content": "hello"}]


class FailingEngine:
    """Samples the token ids of "abc..." one by one, then fails after `fail_after` tokens (0:
    before the first) with the error a dead engine process raises."""

    def __init__(self, token_ids: list[int], fail_after: int) -> None:
        self.token_ids = token_ids
        self.fail_after = fail_after
        self.eos_token_ids: frozenset[int] = frozenset()

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        for tok in self.token_ids[: self.fail_after]:
            yield TokenChunk((tok,), (-0.5,), (0,))
        raise EngineUnavailableError("the engine process exited with code -9")

    async def abort(self, request_id: str) -> None:
        pass

    async def pause(self) -> None:
        pass

    async def resume(self) -> None:
        pass

    async def update_weights(self, update: WeightUpdate) -> int:
        raise NotImplementedError

    def version(self) -> int:
        return 0

    async def health(self) -> EngineHealth:
        return EngineHealth(ok=True, paused=False, version=0, running=0, waiting=0)

    async def close(self) -> None:
        pass


class Gw:
    def __init__(self, http: httpx.AsyncClient, store: Store) -> None:
        self.http = http
        self.store = store

    async def session(self) -> tuple[str, dict[str, Any]]:
        run = await self.http.post("/runs", json={"name": "t", "config": {}}, headers=ADMIN)
        run_id: str = run.json()["id"]
        out = await self.http.post(f"/runs/{run_id}/sessions", json={"count": 1}, headers=ADMIN)
        session: dict[str, Any] = out.json()["sessions"][0]
        return run_id, session

    async def detail(self, session: dict[str, Any]) -> dict[str, Any]:
        r = await self.http.get(f"/sessions/{session['id']}", headers=ADMIN)
        assert r.status_code == 200, r.text
        out: dict[str, Any] = r.json()
        return out


async def _gateway(tiny_model: Path, tmp_path: Path, fail_after: int) -> AsyncIterator[Gw]:
    tokenizer = load_tokenizer(tiny_model)
    engine = FailingEngine(tokenizer.encode("abcdefgh", add_special_tokens=False), fail_after)
    store = await Store.connect(f"sqlite:///{tmp_path / 'gw.db'}")
    components = Components(
        engine=engine,
        store=store,
        tokenizer=tokenizer,
        eos_token_ids=frozenset(),
        model_name="tiny",
    )
    app = create_app(GatewaySettings(admin_token="admin-token"), components)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            yield Gw(http, store)
    await store.close()


@pytest.fixture
async def down(tiny_model: Path, tmp_path: Path) -> AsyncIterator[Gw]:
    async for gw in _gateway(tiny_model, tmp_path, fail_after=0):
        yield gw


@pytest.fixture
async def fails_mid_stream(tiny_model: Path, tmp_path: Path) -> AsyncIterator[Gw]:
    async for gw in _gateway(tiny_model, tmp_path, fail_after=3):
        yield gw


def _body(route: str, **kw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny", "max_tokens": 20, "stream": True, **kw}
    if route == "completions":
        body["prompt"] = "hello"
    else:
        body["messages"] = USER
    return body


@pytest.mark.parametrize("route", ["chat/completions", "completions"])
async def test_a_stream_whose_engine_is_down_is_a_503_with_a_json_error(
    down: Gw, route: str
) -> None:
    _, s = await down.session()
    r = await down.http.post(
        f"/sessions/{s['id']}/v1/{route}",
        json=_body(route),
        headers={"Authorization": f"Bearer {s['api_key']}"},
    )
    assert r.status_code == 503, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert "exited with code -9" in err["message"]
    assert (await down.detail(s))["segments"] == []


@pytest.mark.parametrize("route", ["chat/completions", "completions"])
async def test_a_stream_whose_engine_fails_mid_stream_ends_with_an_error_event(
    fails_mid_stream: Gw, route: str
) -> None:
    gw = fails_mid_stream
    run_id, s = await gw.session()
    headers = {"Authorization": f"Bearer {s['api_key']}"}
    async with gw.http.stream(
        "POST", f"/sessions/{s['id']}/v1/{route}", json=_body(route), headers=headers
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line async for line in r.aiter_lines() if line]  # read to a clean end
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))
    assert set(error["error"]) == {"message", "type", "param", "code"}
    assert error["error"]["type"] == "service_unavailable"
    assert "exited with code -9" in error["error"]["message"]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    text = "".join(
        c["choices"][0].get("text") or c["choices"][0]["delta"].get("content") or "" for c in chunks
    )
    assert text == "abc"

    # recorded: one turn, aborted, with the three tokens generated
    detail = await gw.detail(s)
    [reason] = detail["finish_reasons"].values()
    assert reason == "abort"
    [seg] = detail["segments"]
    [(start, end)] = seg["turn_spans"]
    assert end - start == 3
    # ... and never trained
    r = await gw.http.post(f"/sessions/{s['id']}/reward", json={"reward": 1}, headers=ADMIN)
    assert r.status_code == 200, r.text
    assert (await gw.http.post(f"/sessions/{s['id']}/end", headers=ADMIN)).status_code == 200
    [trajectory] = await gw.store.list_trainable(run_id)
    assert trajectory.segments == []
    assert trajectory.aborted_turns == 1


async def test_the_sdk_raises_the_stream_error_event(fails_mid_stream: Gw) -> None:
    gw = fails_mid_stream
    _, s = await gw.session()
    client = openai.AsyncOpenAI(
        base_url=f"http://gw/sessions/{s['id']}/v1", api_key=s["api_key"], http_client=gw.http
    )
    stream = await client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=20, stream=True
    )
    seen = []

    async def read() -> None:
        async for chunk in stream:
            seen.append(chunk.choices[0].delta.content or "")

    with pytest.raises(openai.APIError, match="exited with code -9"):
        await read()
    assert "".join(seen) == "abc"


NEW_ROUTES = {
    "responses": {"model": "tiny", "input": "hello", "max_output_tokens": 20, "stream": True},
    "messages": {"model": "tiny", "messages": USER, "max_tokens": 20, "stream": True},
}


@pytest.mark.parametrize("route", list(NEW_ROUTES))
async def test_responses_and_messages_streams_whose_engine_is_down_are_503s(
    down: Gw, route: str
) -> None:
    _, s = await down.session()
    r = await down.http.post(
        f"/sessions/{s['id']}/v1/{route}",
        json=NEW_ROUTES[route],
        headers={"Authorization": f"Bearer {s['api_key']}"},
    )
    assert r.status_code == 503, r.text
    body = r.json()
    if route == "messages":  # Anthropic's shape
        assert body["type"] == "error"
        assert body["error"]["type"] == "overloaded_error"
    else:
        assert set(body["error"]) == {"message", "type", "param", "code"}
    assert "exited with code -9" in json.dumps(body)
    assert (await down.detail(s))["segments"] == []


def _sse(lines: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of each server-sent event."""
    out, name = [], ""
    for line in lines:
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            out.append((name, json.loads(line.removeprefix("data: "))))
    return out


@pytest.mark.parametrize("route", list(NEW_ROUTES))
async def test_responses_and_messages_streams_fail_mid_stream_with_their_error_event(
    fails_mid_stream: Gw, route: str
) -> None:
    gw = fails_mid_stream
    _, s = await gw.session()
    headers = {"Authorization": f"Bearer {s['api_key']}"}
    async with gw.http.stream(
        "POST", f"/sessions/{s['id']}/v1/{route}", json=NEW_ROUTES[route], headers=headers
    ) as r:
        assert r.status_code == 200
        events = _sse([line async for line in r.aiter_lines() if line])
    name, last = events[-1]
    if route == "responses":
        assert name == "response.failed"
        assert last["response"]["status"] == "failed"
        assert "exited with code -9" in last["response"]["error"]["message"]
        deltas = [d["delta"] for n, d in events if n == "response.output_text.delta"]
    else:
        assert name == "error"
        assert last["error"]["type"] == "overloaded_error"
        assert "exited with code -9" in last["error"]["message"]
        deltas = [d["delta"]["text"] for n, d in events if n == "content_block_delta"]
    assert "".join(deltas) == "abc"
    detail = await gw.detail(s)
    assert list(detail["finish_reasons"].values()) == ["abort"]
    [(start, end)] = detail["segments"][0]["turn_spans"]
    assert end - start == 3
