"""What the bad-request tests share: the app in-process with one run and one session, and the
check of a refused request (its status, OpenAI-shaped body, `param` and message)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx

from engines.local import LocalEngine
from gateway.settings import GatewaySettings
from rlgateway.app import create_app
from store import Store
from tests.support.admin_client import ADMIN, bearer
from tests.support.components import tiny_components

USER = [{"role": "user", "content": "hello"}]
BODY_LIMIT = 64 * 1024
BIG = 2**64


class Gw:
    """The app, its store, and one run with one session."""

    def __init__(self, http: httpx.AsyncClient, store: Store, model_dir: Path) -> None:
        self.http = http
        self.store = store
        self.model_dir = model_dir
        """The model directory whose tokenizer (and chat template) the app renders with."""
        self.run: dict[str, Any] = {}
        self.s: dict[str, Any] = {}
        self.family = ""
        """The model family whose template and parser the app uses, where a test sets one."""

    @property
    def key(self) -> dict[str, str]:
        return bearer(self.s["api_key"])

    async def post(self, route: str, body: Any) -> httpx.Response:
        """POST `body` (a dict, or raw JSON text) to the session's `/v1/{route}`."""
        url = f"/sessions/{self.s['id']}/v1/{route}"
        if isinstance(body, str):
            headers = {**self.key, "content-type": "application/json"}
            return await self.http.post(url, content=body.encode(), headers=headers)
        return await self.http.post(url, json=body, headers=self.key)

    async def chat(self, **body: Any) -> httpx.Response:
        return await self.post("chat/completions", {"messages": USER, "max_tokens": 2, **body})

    async def recorded(self) -> list[list[str]]:
        """The completion ids of the session's segments."""
        r = await self.http.get(f"/sessions/{self.s['id']}", headers=ADMIN)
        assert r.status_code == 200, r.text
        return [seg["completion_ids"] for seg in r.json()["segments"]]

    async def still_serves(self) -> None:
        """A good request is answered and recorded, after whatever came before."""
        before = await self.recorded()
        r = await self.chat(seed=0)
        assert r.status_code == 200, r.text
        assert await self.recorded() == [*before, [r.json()["id"]]]


@asynccontextmanager
async def edge_app(
    engine: LocalEngine,
    tiny_model: Path,
    tmp_path: Path,
    config: dict[str, Any] | None = None,
    **settings: Any,
) -> AsyncIterator[Gw]:
    """The app on `engine` with a 64 KiB body limit, one run (with `config`) and one session.
    `tiny_model`: the directory whose tokenizer and chat template the app renders with (the
    engine's vocabulary); `settings`: more `GatewaySettings` (a `tool_parser`)."""
    store = await Store.connect(f"sqlite:///{tmp_path / 'bad.db'}")
    components = tiny_components(engine, store, tiny_model)
    app = create_app(
        GatewaySettings(admin_token="admin-token", max_body_bytes=BODY_LIMIT, **settings),
        components,
    )
    try:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(
                transport=transport, base_url="http://gw", timeout=60
            ) as http:
                g = Gw(http, store, tiny_model)
                r = await http.post(
                    "/runs", json={"name": "bad", "config": config or {}}, headers=ADMIN
                )
                g.run = r.json()
                r = await http.post(f"/runs/{g.run['id']}/sessions", json={}, headers=ADMIN)
                g.s = r.json()["sessions"][0]
                yield g
    finally:
        await store.close()


def refused(r: httpx.Response, status: int, param: str | None, *needles: str) -> None:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    for needle in (param or "", *needles):
        assert needle in err["message"], err["message"]
