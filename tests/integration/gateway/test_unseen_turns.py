"""What the agent never saw is not trained, and one request cannot stall the others.

- A non-streaming client that disconnects aborts its generation; the turn is recorded aborted
  and never trained, and a request repeating it takes its place in the segment.
- Retries yield one turn: an `Idempotency-Key` replays the answer; the openai SDK's own retries
  after timeouts (`x-stainless-retry-count`) leave no turn the agent never saw in training.
- A retry after a turn committed but never received (the gateway restarted in between)
  continues the segment without a prefix break.
- A 7 MB message is rendered and tokenized off the event loop: `/health` keeps answering.

In-process (httpx over ASGI, or raw ASGI for a client that hangs up) on the real local engine and
SQLite, and one test against a real `rlgateway serve` with the openai SDK.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from engines.local import LocalEngine
from gateway.settings import GatewaySettings
from rlgateway.app import create_app
from store import Store
from store.types import Trajectory
from tests.support.components import tiny_components
from tests.support.gateway_server import run_gateway
from trainer.algorithms.config import AlgorithmConfig
from trainer.sequences import build_sequences

ADMIN = {"Authorization": "Bearer admin-token"}
USER = [{"role": "user", "content": "hello"}]
FOREVER = {"max_tokens": 1900, "ignore_eos": True}


class Gw:
    def __init__(self, app: Any, http: httpx.AsyncClient, store: Store) -> None:
        self.app = app
        self.http = http
        self.store = store

    async def session(self, run_id: str | None = None) -> dict[str, Any]:
        if run_id is None:
            run = await self.http.post("/runs", json={"name": "t", "config": {}}, headers=ADMIN)
            run_id = run.json()["id"]
        out = await self.http.post(f"/runs/{run_id}/sessions", json={"count": 1}, headers=ADMIN)
        assert out.status_code == 201, out.text
        session: dict[str, Any] = out.json()["sessions"][0]
        return session

    async def chat(
        self,
        s: dict[str, Any],
        messages: list[dict[str, Any]],
        headers: dict[str, str] | None = None,
        **kw: Any,
    ) -> httpx.Response:
        body = {"model": "tiny", "messages": messages, "max_tokens": 4, "seed": 0, **kw}
        return await self.http.post(
            f"/sessions/{s['id']}/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {s['api_key']}", **(headers or {})},
        )

    async def detail(self, s: dict[str, Any]) -> dict[str, Any]:
        r = await self.http.get(f"/sessions/{s['id']}", headers=ADMIN)
        assert r.status_code == 200, r.text
        out: dict[str, Any] = r.json()
        return out

    async def trajectory(self, s: dict[str, Any]) -> Trajectory:
        """End and reward the session, and read it back as the trainer claims it."""
        r = await self.http.post(f"/sessions/{s['id']}/reward", json={"reward": 1}, headers=ADMIN)
        assert r.status_code == 200, r.text
        assert (await self.http.post(f"/sessions/{s['id']}/end", headers=ADMIN)).status_code == 200
        [t] = [t for t in await self.store.list_trainable(s["run_id"]) if t.session.id == s["id"]]
        return t


async def _gateway(engine: LocalEngine, tiny_model: Path, url: str) -> AsyncIterator[Gw]:
    store = await Store.connect(url)
    components = tiny_components(engine, store, tiny_model)
    app = create_app(GatewaySettings(admin_token="admin-token"), components)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            yield Gw(app, http, store)
    await store.close()


@pytest.fixture
async def gw(engine: LocalEngine, tiny_model: Path, tmp_path: Path) -> AsyncIterator[Gw]:
    async for g in _gateway(engine, tiny_model, f"sqlite:///{tmp_path / 'gw.db'}"):
        yield g


async def post_and_hang_up(
    app: Any, path: str, body: dict[str, Any], api_key: str, after_s: float
) -> int:
    """POST `body` as raw ASGI and disconnect after `after_s` seconds without reading the
    answer; returns the status the app then sent."""
    data = json.dumps(body).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"host", b"gw"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(data)).encode()),
            (b"authorization", f"Bearer {api_key}".encode()),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("gw", 80),
    }
    messages = [{"type": "http.request", "body": data, "more_body": False}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop()
        await asyncio.sleep(after_s)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return int(next(m["status"] for m in sent if m["type"] == "http.response.start"))


def sampled_turns(t: Trajectory) -> list[int]:
    """Sampled tokens per trained turn of the trajectory, as the trainer builds its sequences."""
    built = build_sequences([t], AlgorithmConfig())
    assert sum(seq.num_loss_tokens for seq in built.sequences) == sum(
        b - a for seg in t.segments for a, b in seg.turn_spans
    )
    return [b - a for seg in t.segments for a, b in seg.turn_spans]


async def test_a_client_that_disconnects_aborts_its_turn_and_its_retry_takes_its_place(
    gw: Gw,
) -> None:
    s = await gw.session()
    path = f"/sessions/{s['id']}/v1/chat/completions"
    body = {"model": "tiny", "messages": USER, "seed": 0, **FOREVER}
    t0 = time.perf_counter()
    assert await post_and_hang_up(gw.app, path, body, s["api_key"], after_s=0.3) == 499
    assert time.perf_counter() - t0 < 10, "the generation went on after its client had left"

    detail = await gw.detail(s)
    [aborted] = detail["finish_reasons"]
    assert detail["finish_reasons"][aborted] == "abort"
    [seg] = detail["segments"]
    [(start, end)] = seg["turn_spans"]
    assert 1 <= end - start < 1900

    # the client asks again (no retry header needed: the last turn was aborted)
    again = await gw.chat(s, USER)
    assert again.status_code == 200, again.text
    detail = await gw.detail(s)
    assert detail["prefix_breaks"] == 0
    assert [g["completion_ids"] for g in detail["segments"]] == [[again.json()["id"]]]
    assert detail["segments"][0]["tokens"][:start] == seg["tokens"][:start]

    t = await gw.trajectory(s)
    assert sampled_turns(t) == [again.json()["usage"]["completion_tokens"]]


@pytest.mark.parametrize("after_s", [0.0, 0.05])
async def test_a_stream_whose_client_leaves_at_once_leaves_nothing_running(
    gw: Gw, engine: LocalEngine, after_s: float
) -> None:
    """Gone before its first event was read (or before its first token): the generation stops,
    the session's segment is free, and asking again takes the aborted turn's place."""
    s = await gw.session()
    path = f"/sessions/{s['id']}/v1/chat/completions"
    body = {"model": "tiny", "messages": USER, "stream": True, **FOREVER}
    await post_and_hang_up(gw.app, path, body, s["api_key"], after_s=after_s)
    deadline = time.monotonic() + 5
    while (await engine.health()).running and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert (await engine.health()).running == 0
    again = await gw.chat(s, USER)
    assert again.status_code == 200, again.text
    detail = await gw.detail(s)
    assert detail["prefix_breaks"] == 0
    assert [g["completion_ids"] for g in detail["segments"]] == [[again.json()["id"]]]


async def test_an_aborted_turn_is_not_trained(gw: Gw) -> None:
    """Left as the session's last turn, an aborted turn is cut out of what the trainer gets."""
    s = await gw.session()
    first = await gw.chat(s, USER)
    path = f"/sessions/{s['id']}/v1/chat/completions"
    follow = [*USER, first.json()["choices"][0]["message"], {"role": "user", "content": "more"}]
    body = {"model": "tiny", "messages": follow, **FOREVER}
    assert await post_and_hang_up(gw.app, path, body, s["api_key"], after_s=0.3) == 499
    detail = await gw.detail(s)
    assert list(detail["finish_reasons"].values())[-1] == "abort"
    assert [len(g["completion_ids"]) for g in detail["segments"]] == [2]

    t = await gw.trajectory(s)
    assert t.aborted_turns == 1
    assert [seg.completion_ids for seg in t.segments] == [[first.json()["id"]]]
    assert sampled_turns(t) == [first.json()["usage"]["completion_tokens"]]
    assert build_sequences([t], AlgorithmConfig()).aborted_turns == 1


async def test_an_idempotency_key_yields_one_turn(gw: Gw) -> None:
    s = await gw.session()
    key = {"Idempotency-Key": "turn-1"}
    first = await gw.chat(s, USER, key)
    assert first.status_code == 200, first.text
    assert "idempotent-replayed" not in first.headers
    again = await gw.chat(s, USER, key)
    assert again.status_code == 200
    assert again.headers["idempotent-replayed"] == "true"
    assert again.json() == first.json()

    # two attempts at once: one runs, the other waits for it and gets its answer
    follow = [*USER, first.json()["choices"][0]["message"], {"role": "user", "content": "more"}]
    both = await asyncio.gather(*(gw.chat(s, follow, {"Idempotency-Key": "turn-2"}) for _ in "ab"))
    assert [r.status_code for r in both] == [200, 200]
    assert both[0].json() == both[1].json()
    assert sorted(r.headers.get("idempotent-replayed", "") for r in both) == ["", "true"]

    detail = await gw.detail(s)
    assert detail["prefix_breaks"] == 0
    assert [g["completion_ids"] for g in detail["segments"]] == [
        [first.json()["id"], both[0].json()["id"]]
    ]
    # a key names one request: another body under it is refused
    r = await gw.chat(s, [{"role": "user", "content": "other"}], key)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "Idempotency-Key"


async def test_a_retry_after_an_unseen_turn_continues_the_segment(
    engine: LocalEngine, tiny_model: Path, tmp_path: Path
) -> None:
    """The gateway committed a turn and went down before answering; the SDK's retry reaches the
    restarted gateway, which knows nothing of the attempt: the retry takes the unseen turn's
    place instead of forking the session."""
    url = f"sqlite:///{tmp_path / 'restart.db'}"
    async for gw in _gateway(engine, tiny_model, url):
        s = await gw.session()
        first = (await gw.chat(s, USER)).json()
        follow = [*USER, first["choices"][0]["message"], {"role": "user", "content": "more"}]
        unseen = await gw.chat(s, follow, {"x-stainless-retry-count": "0"})
        assert unseen.status_code == 200
    async for gw in _gateway(engine, tiny_model, url):
        retry = await gw.chat(s, follow, {"x-stainless-retry-count": "1"})
        assert retry.status_code == 200, retry.text
        assert retry.json()["id"] != unseen.json()["id"]
        detail = await gw.detail(s)
        assert detail["prefix_breaks"] == 0
        assert [g["completion_ids"] for g in detail["segments"]] == [
            [first["id"], retry.json()["id"]]
        ]
        # a reply the client did get is never taken back: asking the same again is a new sample
        resample = await gw.chat(s, follow)
        assert resample.status_code == 200
        assert (await gw.detail(s))["prefix_breaks"] == 1

        t = await gw.trajectory(s)
        assert [seg.completion_ids for seg in t.segments] == [
            [first["id"], retry.json()["id"]],
            [resample.json()["id"]],
        ]


@pytest.mark.slow
async def test_a_7mb_message_does_not_stall_health(gw: Gw) -> None:
    s = await gw.session()
    big = [{"role": "user", "content": "lorem ipsum " * 583_000}]  # 7.0 MB, under the 8 MB limit
    started = time.perf_counter()
    request = asyncio.create_task(gw.chat(s, big))
    latencies = []
    while not request.done():
        t0 = time.perf_counter()
        r = await gw.http.get("/health")
        latencies.append(time.perf_counter() - t0)
        assert r.status_code == 200
        await asyncio.sleep(0.02)
    answer = await request
    took = time.perf_counter() - started
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["code"] == "context_length_exceeded"
    assert len(latencies) >= 10, "the request was answered before /health was measured"
    # Not a deadline (the machine may be busy): rendered and tokenized on the event loop, the
    # request would hold /health for about its whole time; off it, /health waits at most for the
    # tokenizer's hold of the GIL (a fraction of a second of the ~8 s it takes here).
    print(
        f"/health during a 7 MB message: {len(latencies)} calls in {took:.1f} s,"
        f" longest {max(latencies):.3f} s"
    )
    assert max(latencies) < took / 4, f"/health waited {max(latencies):.2f} s of {took:.2f} s"


@pytest.mark.slow
def _ask(protocol: str, s: dict[str, Any], timeout: float, max_tokens: int) -> tuple[str, int]:
    """One request of the SDK of `protocol` with its own retries: (the reply's id, its sampled
    tokens). `ignore_eos`: the tiny model runs to `max_tokens`."""
    extra = {"ignore_eos": True}
    if protocol == "messages":
        with anthropic.Anthropic(
            base_url=s["base_url"].removesuffix("/v1"), api_key=s["api_key"], timeout=timeout
        ) as a:
            m = a.messages.create(
                model="tiny", messages=USER, max_tokens=max_tokens, extra_body=extra
            )
            return m.id, m.usage.output_tokens
    with openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], timeout=timeout) as o:
        if protocol == "responses":
            r = o.responses.create(
                model="tiny",
                input=USER,
                max_output_tokens=max_tokens,
                extra_body=extra,  # type: ignore[arg-type]
            )
            assert r.usage is not None
            return r.id, r.usage.output_tokens
        c = o.chat.completions.create(
            model="tiny", messages=USER, max_tokens=max_tokens, extra_body=extra
        )
        assert c.usage is not None
        return c.id, c.usage.completion_tokens


@pytest.mark.parametrize("protocol", ["chat", "responses", "messages"])
def test_sdk_retries_after_timeouts_train_no_turn_the_agent_never_saw(
    tiny_model: Path, tmp_path: Path, protocol: str
) -> None:
    """The SDK (openai, or anthropic on Messages) times out (its default 2 retries, each a new
    attempt of the same body): every attempt is aborted when its client leaves, each retry takes
    the previous attempt's place in the one segment, and none is trained; the agent's next
    request with a longer timeout yields the session's one trained turn."""
    with run_gateway(tiny_model, tmp_path) as gw:
        run_id = gw.create_run()
        s = gw.new_session(run_id=run_id)
        # 2000 tokens take the tiny model about 1 s on an idle core, several under load: a
        # quarter second times every attempt out wherever this runs
        t0 = time.perf_counter()
        with pytest.raises((openai.APITimeoutError, anthropic.APITimeoutError)):
            _ask(protocol, s, 0.25, 2000)
        print(f"3 attempts timed out in {time.perf_counter() - t0:.1f} s")
        db = sqlite3.connect(gw.database_url.removeprefix("sqlite:///"))

        def statuses() -> list[str]:
            rows = db.execute(
                "SELECT status FROM completions WHERE session_id = ? ORDER BY turn", (s["id"],)
            )
            return [status for (status,) in rows]

        deadline = time.monotonic() + 10
        while len(statuses()) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert statuses() == ["replaced", "replaced", "aborted"]
        detail = gw.session(s["id"])
        assert detail["prefix_breaks"] == 0
        assert list(detail["finish_reasons"].values()) == ["abort"]

        reply_id, sampled = _ask(protocol, s, 60, 4)
        assert statuses() == ["replaced", "replaced", "replaced", "ok"]
        assert gw.session(s["id"])["prefix_breaks"] == 0
        assert gw.client.post(f"/sessions/{s['id']}/reward", json={"reward": 1}).status_code == 200
        assert gw.client.post(f"/sessions/{s['id']}/end").status_code == 200

        async def trainable() -> list[Trajectory]:
            store = await Store.connect(gw.database_url)
            try:
                return await store.list_trainable(run_id)
            finally:
                await store.close()

        [t] = asyncio.run(trainable())
        assert [seg.completion_ids for seg in t.segments] == [[reply_id]]
        assert sampled_turns(t) == [sampled]
        db.close()
