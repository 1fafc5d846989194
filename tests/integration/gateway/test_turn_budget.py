"""The turn budget (`store.run_config`, `max_tokens`) through the real gateway (in-process over
ASGI, local engine, SQLite) and the real SDKs: a run that sets `max_tokens` caps every turn's new
tokens at it, in every protocol, whatever the client asks (or when it asks nothing), and says so
in `x-rlgateway-max-tokens` and in the turn's record; a run that sets none is untouched."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import pytest

from engines.local import LocalEngine
from gateway.settings import GatewaySettings
from rlgateway.app import create_app
from store import Store
from store.run_config import MAX_TOKENS_HEADER
from store.types import JSON
from tests.support.components import tiny_components

ADMIN = {"Authorization": "Bearer admin-token"}
USER = [{"role": "user", "content": "hello"}]
CAP = 8
ASKED = 500
LONG = {"ignore_eos": True}
"""Every reply runs to its maximum, so a count of new tokens shows the maximum it had."""


class Gw:
    def __init__(self, http: httpx.AsyncClient, http2: httpx2.AsyncClient, store: Store) -> None:
        self.http = http
        self.http2 = http2
        """The same app for the anthropic SDK, which speaks httpx2."""
        self.store = store

    async def session(self, config: JSON) -> dict[str, Any]:
        """A new session of a new run with `config`."""
        run = await self.http.post("/runs", json={"name": "t", "config": config}, headers=ADMIN)
        assert run.status_code == 201, run.text
        out = await self.http.post(
            f"/runs/{run.json()['id']}/sessions", json={"count": 1}, headers=ADMIN
        )
        assert out.status_code == 201, out.text
        session: dict[str, Any] = out.json()["sessions"][0]
        return session

    def openai(self, s: dict[str, Any]) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"http://gw/sessions/{s['id']}/v1",
            api_key=s["api_key"],
            http_client=self.http,
            max_retries=0,
        )

    def anthropic(self, s: dict[str, Any]) -> anthropic.AsyncAnthropic:
        return anthropic.AsyncAnthropic(
            base_url=f"http://gw/sessions/{s['id']}",
            api_key=s["api_key"],
            http_client=self.http2,
            max_retries=0,
        )

    async def records(self, s: dict[str, Any]) -> list[JSON]:
        """The session's turns' sampling records, in turn order."""
        detail = await self.store.session_detail(s["id"])
        return [r for seg in detail.segments for r in seg.turn_sampling]


@pytest.fixture
async def gw(engine: LocalEngine, tiny_model: Path, tmp_path: Path) -> AsyncIterator[Gw]:
    store = await Store.connect(f"sqlite:///{tmp_path / 'gw.db'}")
    app = create_app(
        GatewaySettings(admin_token="admin-token"), tiny_components(engine, store, tiny_model)
    )
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        transport2 = httpx2.ASGITransport(app=app)
        async with (
            httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=60) as h,
            httpx2.AsyncClient(transport=transport2, timeout=60) as h2,
        ):
            yield Gw(h, h2, store)
    await store.close()


async def test_a_chat_turn_of_a_capped_run_gets_at_most_the_runs_max_tokens(gw: Gw) -> None:
    s = await gw.session({"max_tokens": CAP})
    client = gw.openai(s)
    raw = await client.chat.completions.with_raw_response.create(
        model="tiny", messages=USER, max_tokens=ASKED, extra_body=LONG
    )
    assert raw.headers[MAX_TOKENS_HEADER] == f"capped {CAP}"
    reply = raw.parse()
    assert reply.usage is not None
    assert reply.usage.completion_tokens == CAP
    assert reply.choices[0].finish_reason == "length"
    # max_completion_tokens, and no maximum at all, are capped alike; a lower one is kept
    for asked, got in (({"max_completion_tokens": ASKED}, CAP), ({}, CAP), ({"max_tokens": 3}, 3)):
        raw = await client.chat.completions.with_raw_response.create(
            model="tiny",
            messages=USER,
            extra_body=LONG,
            **asked,
        )
        assert raw.headers[MAX_TOKENS_HEADER] == f"capped {CAP}"
        usage = raw.parse().usage
        assert usage is not None
        assert usage.completion_tokens == got, asked
    records = await gw.records(s)
    assert [r["max_new_tokens"] for r in records] == [CAP, CAP, CAP, 3]
    assert {r["max_tokens_cap"] for r in records} == {CAP}


async def test_a_capped_chat_stream_ends_at_the_cap(gw: Gw) -> None:
    s = await gw.session({"max_tokens": CAP})
    raw = await gw.openai(s).chat.completions.with_raw_response.create(
        model="tiny",
        messages=USER,
        max_tokens=ASKED,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=LONG,
    )
    assert raw.headers[MAX_TOKENS_HEADER] == f"capped {CAP}"
    chunks = [c async for c in raw.parse()]
    usage = [c.usage for c in chunks if c.usage is not None]
    assert [u.completion_tokens for u in usage] == [CAP]


async def test_responses_messages_and_completions_are_capped_too(gw: Gw) -> None:
    s = await gw.session({"max_tokens": CAP})
    client = gw.openai(s)
    raw_response = await client.responses.with_raw_response.create(
        model="tiny", input="hello", max_output_tokens=ASKED, extra_body=LONG
    )
    assert raw_response.headers[MAX_TOKENS_HEADER] == f"capped {CAP}"
    response = raw_response.parse()
    assert response.usage is not None
    assert response.usage.output_tokens == CAP
    assert response.status == "incomplete"

    raw_message = await gw.anthropic(s).messages.with_raw_response.create(
        model="tiny", messages=USER, max_tokens=ASKED, extra_body=LONG
    )
    assert raw_message.headers[MAX_TOKENS_HEADER] == f"capped {CAP}"
    message = await raw_message.parse()
    assert message.usage.output_tokens == CAP
    assert message.stop_reason == "max_tokens"

    raw_completion = await client.completions.with_raw_response.create(
        model="tiny", prompt="hello", max_tokens=ASKED, extra_body=LONG
    )
    assert raw_completion.headers[MAX_TOKENS_HEADER] == f"capped {CAP}"
    completion = raw_completion.parse()
    assert completion.usage is not None
    assert completion.usage.completion_tokens == CAP

    records = await gw.records(s)
    assert len(records) == 3  # one turn per protocol
    assert {(r["max_new_tokens"], r["max_tokens_cap"]) for r in records} == {(CAP, CAP)}


async def test_a_run_without_max_tokens_is_not_capped(gw: Gw) -> None:
    s = await gw.session({"temperature": 0.7})
    client = gw.openai(s)
    raw = await client.chat.completions.with_raw_response.create(
        model="tiny", messages=USER, max_tokens=20, extra_body=LONG
    )
    assert MAX_TOKENS_HEADER not in raw.headers
    usage = raw.parse().usage
    assert usage is not None
    assert usage.completion_tokens == 20
    raw_message = await gw.anthropic(s).messages.with_raw_response.create(
        model="tiny", messages=USER, max_tokens=20, extra_body=LONG
    )
    assert MAX_TOKENS_HEADER not in raw_message.headers
    assert (await raw_message.parse()).usage.output_tokens == 20
    records = await gw.records(s)
    assert [r["max_new_tokens"] for r in records] == [20, 20]
    assert not any("max_tokens_cap" in r for r in records)
    # the admin's unrecorded calls belong to no run: never capped
    admin = openai.AsyncOpenAI(
        base_url="http://gw/v1", api_key="admin-token", http_client=gw.http, max_retries=0
    )
    raw = await admin.chat.completions.with_raw_response.create(
        model="tiny", messages=USER, max_tokens=20, extra_body=LONG
    )
    assert MAX_TOKENS_HEADER not in raw.headers


async def test_the_runs_cap_is_a_limit_not_a_demand(gw: Gw) -> None:
    """A chat turn that asks no maximum on a capped run, whose prompt leaves less room in the
    model's context than the cap, generates up to the room left (as without a cap); one that asks
    more than the room is still chat's 400."""
    s = await gw.session({"max_tokens": CAP})
    long = [{"role": "user", "content": " a" * 1012}]  # 2043 of the tiny model's 2048 positions
    client = gw.openai(s)
    reply = await client.chat.completions.create(model="tiny", messages=long, extra_body=LONG)
    assert reply.usage is not None
    room = 2048 - reply.usage.prompt_tokens
    assert 1 <= room < CAP
    assert reply.usage.completion_tokens == room
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(
            model="tiny", messages=long, max_tokens=ASKED, extra_body=LONG
        )
