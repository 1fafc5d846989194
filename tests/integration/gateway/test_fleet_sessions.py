"""Gateways that share one PostgreSQL database are one gateway to their agents.

- A session whose turns alternate between two gateways is one exact segment, token for token
  what one gateway records for the same conversation.
- One session sent two requests at once, at two gateways, forks as it does at one gateway: both
  are answered and recorded, the later one in a segment of its own (its prompt context only).
- Staleness admission counts the sessions every gateway created: concurrent creates at two
  gateways never admit past the bound.

In-process: two gateway apps, each with its own `Store` on one real PostgreSQL database (what two
`rlgateway serve` processes hold), on one local engine; `tests/integration/deployment/test_fleet.py`
runs real processes behind HAProxy.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engines.local import LocalEngine
from gateway.settings import GatewaySettings
from rlgateway.app import create_app
from store import Store
from tests.store_fixtures import create_postgres_database, drop_postgres_database
from tests.support.components import tiny_components

pytestmark = pytest.mark.postgres

ADMIN = {"Authorization": "Bearer admin-token"}


@pytest.fixture(scope="module")
def pg_url() -> Iterator[str]:
    url = create_postgres_database()
    yield url
    drop_postgres_database(url)


class Gw:
    def __init__(self, http: httpx.AsyncClient, store: Store) -> None:
        self.http = http
        self.store = store

    async def chat(self, s: dict[str, Any], messages: list[dict[str, Any]], **kw: Any) -> Any:
        body = {"model": "tiny", "messages": messages, "max_tokens": 6, "seed": 1, **kw}
        r = await self.http.post(
            f"/sessions/{s['id']}/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {s['api_key']}"},
        )
        assert r.status_code == 200, r.text
        return r.json()

    async def detail(self, session_id: str) -> dict[str, Any]:
        r = await self.http.get(f"/sessions/{session_id}", headers=ADMIN)
        assert r.status_code == 200, r.text
        out: dict[str, Any] = r.json()
        return out


async def _gateway(engine: LocalEngine, tiny_model: Path, url: str) -> AsyncIterator[Gw]:
    store = await Store.connect(url)
    app = create_app(
        GatewaySettings(admin_token="admin-token"), tiny_components(engine, store, tiny_model)
    )
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            yield Gw(http, store)
    await store.close()


@pytest.fixture
async def pair(engine: LocalEngine, tiny_model: Path, pg_url: str) -> AsyncIterator[list[Gw]]:
    async for a in _gateway(engine, tiny_model, pg_url):
        async for b in _gateway(engine, tiny_model, pg_url):
            yield [a, b]


async def _run(gw: Gw, config: dict[str, Any] | None = None) -> str:
    r = await gw.http.post("/runs", json={"name": "fleet", "config": config or {}}, headers=ADMIN)
    assert r.status_code == 201, r.text
    run_id: str = r.json()["id"]
    return run_id


async def _sessions(gw: Gw, run_id: str, count: int = 1) -> httpx.Response:
    return await gw.http.post(f"/runs/{run_id}/sessions", json={"count": count}, headers=ADMIN)


async def _conversation(gateways: list[Gw], run_id: str, turns: int) -> list[list[int]]:
    """`turns` turns of one session, turn i at gateway i % len(gateways); the session's
    segments as token lists."""
    r = await _sessions(gateways[0], run_id)
    assert r.status_code == 201, r.text
    s = r.json()["sessions"][0]
    messages: list[dict[str, Any]] = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"step {turn}: go on"})
        reply = await gateways[turn % len(gateways)].chat(s, messages)
        messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
    detail = await gateways[0].detail(s["id"])
    assert detail["prefix_breaks"] == 0, json.dumps(detail)[:2000]
    return [list(seg.tokens) for seg in await gateways[-1].store.load_segments(s["id"])]


async def test_turns_alternating_gateways_are_one_exact_segment(pair: list[Gw]) -> None:
    run_id = await _run(pair[0])
    alternating = await _conversation(pair, run_id, turns=6)
    alone = await _conversation(pair[:1], run_id, turns=6)
    assert len(alternating) == 1
    assert alternating == alone  # token for token what one gateway records


async def test_one_session_at_two_gateways_at_once_forks(pair: list[Gw]) -> None:
    a, b = pair
    run_id = await _run(a)
    s = (await _sessions(a, run_id)).json()["sessions"][0]
    first = [{"role": "user", "content": "hello"}]
    reply = await b.chat(s, first)
    follow = [*first, reply["choices"][0]["message"], {"role": "user", "content": "and then?"}]

    # both are planned on the first segment before either is recorded (each samples 48 tokens,
    # the plans take milliseconds): the one recorded second finds the segment moved
    long = {"max_tokens": 48, "ignore_eos": True}
    answers = await asyncio.gather(a.chat(s, follow, **long), b.chat(s, follow, **long))

    detail = await a.store.session_detail(s["id"])
    assert detail.info.prefix_breaks == 1
    first_segment, fork = detail.segments
    assert first_segment.completion_ids[0] == reply["id"]
    assert {first_segment.completion_ids[1], *fork.completion_ids} == {x["id"] for x in answers}
    # the fork's prompt (the first turn and the follow-up) is context: only its own 48 sampled
    # tokens are trained there, so no token is trained twice
    assert sum(fork.loss_mask) == 48
    assert fork.tokens[:-48] == first_segment.tokens[:-48]


async def test_staleness_admission_counts_every_gateways_sessions(pair: list[Gw]) -> None:
    run_id = await _run(pair[0], {"eta": 0, "batch_size": 4})
    answers = await asyncio.gather(*(_sessions(pair[i % 2], run_id) for i in range(10)))
    codes = sorted(r.status_code for r in answers)
    assert codes == [201] * 4 + [429] * 6, [r.text for r in answers]
    running, _ = await pair[1].store.run_counts(run_id)
    assert running == 4


async def test_a_run_key_replaced_at_one_gateway_stops_working_at_the_other(
    pair: list[Gw],
) -> None:
    a, b = pair
    r = await a.http.post("/runs", json={"name": "keys", "config": {}}, headers=ADMIN)
    run_id, old = r.json()["id"], r.json()["api_key"]

    async def sessions_with(gw: Gw, key: str) -> int:
        auth = {"Authorization": f"Bearer {key}"}
        answer = await gw.http.post(f"/runs/{run_id}/sessions", json={"count": 1}, headers=auth)
        return answer.status_code

    assert await sessions_with(b, old) == 201  # b knows the old key now
    new = (await a.http.post(f"/runs/{run_id}/key", headers=ADMIN)).json()["api_key"]
    assert await sessions_with(b, old) == 401
    assert await sessions_with(b, new) == 201


async def test_a_retry_at_the_other_gateway_takes_the_place_of_an_unseen_turn(
    pair: list[Gw],
) -> None:
    """A turn recorded at one gateway whose client never got the reply (the gateway died
    before sending it); the client's SDK retries, and the balancer sends it to the other one."""
    a, b = pair
    run_id = await _run(a)
    s = (await _sessions(a, run_id)).json()["sessions"][0]
    first = [{"role": "user", "content": "hello"}]
    seen = await b.chat(s, first)  # b holds the session's state from here on
    follow = [*first, seen["choices"][0]["message"], {"role": "user", "content": "more"}]
    unseen = await a.chat(s, follow)  # recorded; say its client never got it
    retry = await b.http.post(
        f"/sessions/{s['id']}/v1/chat/completions",
        json={"model": "tiny", "messages": follow, "max_tokens": 6, "seed": 2},
        headers={"Authorization": f"Bearer {s['api_key']}", "x-stainless-retry-count": "1"},
    )
    assert retry.status_code == 200, retry.text
    detail = await b.store.session_detail(s["id"])
    assert detail.info.prefix_breaks == 0
    assert [seg.completion_ids for seg in detail.segments] == [[seen["id"], retry.json()["id"]]]
    assert unseen["id"] not in detail.segments[0].completion_ids
