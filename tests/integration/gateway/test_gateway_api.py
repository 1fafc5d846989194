"""The gateway's HTTP contract, in-process (httpx over ASGI) on the real local engine and a real
SQLite store: errors in OpenAI's shape, nothing recorded for rejected requests, and how requests
map onto segments (extension, prefix breaks, parallel forks, sibling choices, restarts)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engines.local import LocalEngine, LocalEngineConfig
from engines.process import ProcessEngine
from engines.tiny_model import load_tokenizer
from gateway.settings import GatewaySettings
from rlgateway.app import create_app
from store import Store
from tests.support.components import tiny_components

ADMIN = {"Authorization": "Bearer admin-token"}


class Client:
    def __init__(self, http: httpx.AsyncClient, store: Store) -> None:
        self.http = http
        self.store = store

    async def session(self, **body: Any) -> dict[str, Any]:
        run = await self.http.post("/runs", json={"name": "t", "config": {}}, headers=ADMIN)
        assert run.status_code == 201, run.text
        out = await self.http.post(
            f"/runs/{run.json()['id']}/sessions", json={"count": 1, **body}, headers=ADMIN
        )
        assert out.status_code == 201, out.text
        session: dict[str, Any] = out.json()["sessions"][0]
        return session

    async def chat(self, s: dict[str, Any], messages: list[dict[str, Any]], **kw: Any) -> Any:
        body = {"model": "tiny", "messages": messages, "max_tokens": 6, "seed": 0, **kw}
        return await self.http.post(
            f"/sessions/{s['id']}/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {s['api_key']}"},
        )

    async def detail(self, s: dict[str, Any]) -> dict[str, Any]:
        r = await self.http.get(f"/sessions/{s['id']}", headers=ADMIN)
        assert r.status_code == 200, r.text
        out: dict[str, Any] = r.json()
        return out


async def _client(
    engine: LocalEngine | ProcessEngine, tiny_model: Path, url: str
) -> AsyncIterator[Client]:
    store = await Store.connect(url)
    components = tiny_components(engine, store, tiny_model)
    settings = GatewaySettings(admin_token="admin-token", max_body_bytes=64 * 1024)
    app = create_app(settings, components)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            yield Client(http, store)
    await store.close()


@pytest.fixture
async def client(engine: LocalEngine, tiny_model: Path, tmp_path: Path) -> AsyncIterator[Client]:
    async for c in _client(engine, tiny_model, f"sqlite:///{tmp_path / 'gw.db'}"):
        yield c


def assert_openai_error(r: httpx.Response, status: int, *needles: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    for needle in needles:
        assert needle in err["message"], err["message"]


USER = [{"role": "user", "content": "hello"}]


async def test_errors_are_openai_shaped_and_record_nothing(client: Client) -> None:
    s = await client.session()
    url = f"/sessions/{s['id']}/v1/chat/completions"
    key = {"Authorization": f"Bearer {s['api_key']}"}
    http = client.http
    # 401: no key, wrong key
    assert_openai_error(await http.post(url, json={"messages": USER}), 401, "missing API key")
    r = await http.post(url, json={"messages": USER}, headers={"Authorization": "Bearer nope"})
    assert_openai_error(r, 401, "invalid API key")
    # 404: unknown session, and another session's key
    r = await http.post(
        "/sessions/sess_nope/v1/chat/completions", json={"messages": USER}, headers=key
    )
    assert_openai_error(r, 404, "sess_nope")
    # 400: malformed JSON, and schema violations (as OpenAI answers them)
    r = await http.post(
        url, content=b"{not json", headers={**key, "content-type": "application/json"}
    )
    assert_openai_error(r, 400, "not valid JSON")
    assert_openai_error(await http.post(url, json={"messages": []}, headers=key), 400, "messages")
    r = await http.post(url, json={"messages": USER, "n": 0}, headers=key)
    assert_openai_error(r, 400, "n")
    r = await http.post(url, json={"messages": [{"role": "wizard", "content": "x"}]}, headers=key)
    assert_openai_error(r, 400)
    r = await http.post(url, json={"messages": USER, "tool_choice": "required"}, headers=key)
    assert_openai_error(r, 400, "tool_choice needs tools")
    # 400: prompt longer than the context, with both lengths
    long = [{"role": "user", "content": "x" * 3000}]
    r = await http.post(url, json={"messages": long}, headers=key)
    assert_openai_error(r, 400, "3019 tokens", "2048")
    assert r.json()["error"]["code"] == "context_length_exceeded"
    r = await http.post(url, json={"messages": USER, "max_tokens": 5000}, headers=key)
    assert_openai_error(r, 400, "context is 2048")
    # 413: body too large (the test app's limit is 64 KiB)
    r = await http.post(
        url, json={"messages": [{"role": "user", "content": "y" * 70_000}]}, headers=key
    )
    assert_openai_error(r, 413, "larger than")
    # valid OpenAI fields the gateway does not use are accepted
    ok = await client.chat(s, USER, user="someone", presence_penalty=0.0, metadata={"a": "b"})
    assert ok.status_code == 200, ok.text
    # nothing but the one good request was recorded
    d = await client.detail(s)
    assert [seg["completion_ids"] for seg in d["segments"]] == [[ok.json()["id"]]]
    assert d["prefix_breaks"] == 0
    # 409: ended session
    assert (await http.post(f"/sessions/{s['id']}/end", headers=key)).status_code == 200
    assert_openai_error(await client.chat(s, USER), 409, "has ended")
    assert len((await client.detail(s))["segments"]) == 1


async def test_admin_routes_need_the_admin_token(client: Client) -> None:
    r = await client.http.post("/runs", json={"name": "x"})
    assert_openai_error(r, 401, "bearer")
    r = await client.http.post("/runs", json={"name": "x"}, headers={"Authorization": "Bearer x"})
    assert_openai_error(r, 401, "wrong admin token")
    r = await client.http.post("/runs/run_nope/sessions", json={"count": 1}, headers=ADMIN)
    assert_openai_error(r, 404)
    s = await client.session()
    # a session key cannot create runs or touch another session
    other = await client.session()
    r = await client.http.get(
        f"/sessions/{other['id']}", headers={"Authorization": f"Bearer {s['api_key']}"}
    )
    assert_openai_error(r, 404)


async def test_engine_unavailable_is_503(tiny_model: Path, tmp_path: Path) -> None:
    engine = LocalEngine.load(LocalEngineConfig(model=str(tiny_model)))
    async for c in _client(engine, tiny_model, f"sqlite:///{tmp_path / 'x.db'}"):
        s = await c.session()
        await engine.close()
        assert_openai_error(await c.chat(s, USER), 503, "unavailable")
        assert (await c.detail(s))["segments"] == []


async def test_a_dead_engine_process_is_503_for_requests_in_flight_and_new(
    tiny_model: Path, tmp_path: Path
) -> None:
    import os
    import signal

    engine = ProcessEngine.load(LocalEngineConfig(model=str(tiny_model)))
    try:
        async for c in _client(engine, tiny_model, f"sqlite:///{tmp_path / 'x.db'}"):
            s = await c.session()
            long = {"max_tokens": 2000, "ignore_eos": True}
            in_flight = asyncio.create_task(c.chat(s, USER, **long))
            while engine.stats.decode_steps < 3:
                await asyncio.sleep(0.005)
            os.kill(engine.pid, signal.SIGKILL)
            assert_openai_error(await in_flight, 503, "engine process", "exited with code -9")
            assert_openai_error(await c.chat(s, USER), 503, "exited with code -9")
            assert (await c.detail(s))["segments"] == []
            assert not (await c.http.get("/health")).json()["ok"]
    finally:
        await engine.close()


async def test_turns_extend_one_segment_token_for_token(client: Client) -> None:
    s = await client.session()
    messages = list(USER)
    for turn in range(3):
        r = await client.chat(s, messages, seed=turn)
        assert r.status_code == 200, r.text
        messages += [r.json()["choices"][0]["message"], {"role": "user", "content": f"more {turn}"}]
    d = await client.detail(s)
    assert d["prefix_breaks"] == 0
    [seg] = d["segments"]
    n = len(seg["tokens"])
    assert len(seg["loss_mask"]) == len(seg["logprobs"]) == len(seg["versions"]) == n
    spans = seg["turn_spans"]
    assert len(spans) == 3
    sampled = {i for a, b in spans for i in range(a, b)}
    assert [i for i in range(n) if seg["loss_mask"][i]] == sorted(sampled)
    assert all(v == (0 if i in sampled else -1) for i, v in enumerate(seg["versions"]))
    # the segment is the last turn's prompt plus its output: exactly what the engine saw
    tok = client_tokenizer()
    last_prompt = seg["tokens"][: spans[-1][0]]
    rendered = tok.decode(last_prompt, skip_special_tokens=False)
    assert rendered.startswith("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n")
    assert rendered.endswith("<|im_start|>user\nmore 1<|im_end|>\n<|im_start|>assistant\n")


def client_tokenizer() -> Any:
    from engines.tiny_model import tiny_model_dir

    return load_tokenizer(tiny_model_dir())


async def test_edited_history_opens_a_new_segment_and_counts_a_prefix_break(
    client: Client,
) -> None:
    s = await client.session()
    first = (await client.chat(s, USER)).json()
    reply = first["choices"][0]["message"]
    edited = [{"role": "user", "content": "HELLO"}, reply, {"role": "user", "content": "next"}]
    assert (await client.chat(s, edited)).status_code == 200
    d = await client.detail(s)
    assert d["prefix_breaks"] == 1
    assert len(d["segments"]) == 2
    # a changed tool list is a different history too
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    follow = [*USER, reply, {"role": "user", "content": "next"}]
    assert (await client.chat(s, follow, tools=tools)).status_code == 200
    d = await client.detail(s)
    assert d["prefix_breaks"] == 2


async def test_parallel_calls_on_one_history_fork_without_training_twice(client: Client) -> None:
    s = await client.session()
    first = (await client.chat(s, USER)).json()
    follow = [*USER, first["choices"][0]["message"], {"role": "user", "content": "go"}]
    a, b = await asyncio.gather(
        client.chat(s, follow, max_tokens=30, seed=1), client.chat(s, follow, max_tokens=30, seed=2)
    )
    assert a.status_code == b.status_code == 200
    d = await client.detail(s)
    assert len(d["segments"]) == 2
    assert d["prefix_breaks"] == 1
    extended, forked = sorted(d["segments"], key=lambda g: -len(g["completion_ids"]))
    assert len(extended["completion_ids"]) == 2
    assert len(forked["completion_ids"]) == 1
    # the fork holds the shared history as context only: its only sampled tokens are its own
    assert forked["turn_spans"][0][0] == len(extended["tokens"][: extended["turn_spans"][1][0]])
    assert sum(forked["loss_mask"]) == forked["turn_spans"][0][1] - forked["turn_spans"][0][0]


async def test_sibling_choices_each_open_a_segment(client: Client) -> None:
    s = await client.session()
    r = (await client.chat(s, USER, n=3, seed=5)).json()
    ids = [c["completion_id"] for c in r["choices"]]
    assert len(set(ids)) == 3
    d = await client.detail(s)
    assert sorted(g["completion_ids"][0] for g in d["segments"]) == sorted(ids)
    assert d["prefix_breaks"] == 0
    # continuing the second choice extends that choice's segment
    follow = [*USER, r["choices"][1]["message"], {"role": "user", "content": "on"}]
    assert (await client.chat(s, follow)).status_code == 200
    d = await client.detail(s)
    grown = [g for g in d["segments"] if len(g["completion_ids"]) == 2]
    assert len(grown) == 1
    assert grown[0]["completion_ids"][0] == ids[1]


async def test_a_restarted_gateway_continues_the_segment(
    engine: LocalEngine, tiny_model: Path, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'restart.db'}"
    async for c in _client(engine, tiny_model, url):
        s = await c.session()
        first = (await c.chat(s, USER)).json()
    async for c in _client(engine, tiny_model, url):
        follow = [*USER, first["choices"][0]["message"], {"role": "user", "content": "again"}]
        assert (await c.chat(s, follow)).status_code == 200
        d = await c.detail(s)
        assert d["prefix_breaks"] == 0
        assert [len(g["completion_ids"]) for g in d["segments"]] == [2]


async def test_token_prompts_extend_completion_segments(client: Client) -> None:
    s = await client.session()
    key = {"Authorization": f"Bearer {s['api_key']}"}
    url = f"/sessions/{s['id']}/v1/completions"
    r1 = (
        await client.http.post(
            url, json={"prompt": [65, 66, 67], "max_tokens": 4, "seed": 1}, headers=key
        )
    ).json()
    seg = (await client.detail(s))["segments"][0]
    prompt2 = [*seg["tokens"], 10, 68]
    r2 = await client.http.post(url, json={"prompt": prompt2, "max_tokens": 4}, headers=key)
    assert r2.status_code == 200, r2.text
    d = await client.detail(s)
    assert d["prefix_breaks"] == 0
    [seg] = d["segments"]
    assert seg["completion_ids"] == [r1["id"], r2.json()["id"]]
    assert seg["tokens"][: len(prompt2)] == prompt2
    assert seg["loss_mask"][len(prompt2) - 2 : len(prompt2)] == [0, 0]
    # a text prompt on the plain /v1 route with the session key is recorded too
    r3 = await client.http.post(
        "/v1/completions", json={"prompt": "xyz", "max_tokens": 3}, headers=key
    )
    assert r3.status_code == 200
    assert len((await client.detail(s))["segments"]) == 2


async def test_rewards_are_idempotent_and_discounted(client: Client) -> None:
    run = (
        await client.http.post(
            "/runs", json={"name": "r", "config": {"discount": 0.5}}, headers=ADMIN
        )
    ).json()
    s = (
        await client.http.post(f"/runs/{run['id']}/sessions", json={"count": 1}, headers=ADMIN)
    ).json()["sessions"][0]
    key = {"Authorization": f"Bearer {s['api_key']}"}
    messages = list(USER)
    ids = []
    for turn in range(2):
        r = (await client.chat(s, messages)).json()
        ids.append(r["id"])
        messages += [r["choices"][0]["message"], {"role": "user", "content": str(turn)}]
    reward = f"/sessions/{s['id']}/reward"
    r = await client.http.post(
        reward, json={"reward": 1.0, "completion_id": ids[0], "key": "a"}, headers=key
    )
    assert r.json()["recorded"] is True
    r = await client.http.post(
        reward, json={"reward": 1.0, "completion_id": ids[0], "key": "a"}, headers=key
    )
    assert r.json()["recorded"] is False
    r = await client.http.post(
        reward, json={"reward": 2.0, "completion_id": ids[0], "key": "a"}, headers=key
    )
    assert_openai_error(r, 409)
    r = await client.http.post(
        reward, json={"reward": 1.0, "completion_id": "chatcmpl-x"}, headers=key
    )
    assert_openai_error(r, 404)
    await client.http.post(f"/sessions/{s['id']}/end", headers=key)
    r = await client.http.post(reward, json={"reward": 4.0}, headers=key)  # final, after the end
    assert r.json()["recorded"] is True
    d = await client.detail(s)
    assert d["status"] == "ended"
    assert d["returns"] == {ids[0]: 1.0 + 0.5 * 4.0, ids[1]: 4.0}
