"""An in-process gateway (httpx over ASGI) on the real local engine and a real store, for the
admin API and access tests. Import the fixture with
`from tests.support.admin_client import engine  # noqa: F401`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI

from engines.local import LocalEngine
from gateway.settings import GatewaySettings
from rlgateway.app import create_app
from store import Store
from tests.support.components import tiny_components

ADMIN_TOKEN = "admin-token"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
USER = [{"role": "user", "content": "hello"}]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@dataclass
class App:
    http: httpx.AsyncClient
    store: Store
    app: FastAPI

    async def run(self, config: dict[str, Any] | None = None, name: str = "t") -> dict[str, Any]:
        r = await self.http.post(
            "/runs", json={"name": name, "config": config or {}}, headers=ADMIN
        )
        assert r.status_code == 201, r.text
        out: dict[str, Any] = r.json()
        return out

    async def sessions(self, run_id: str, count: int = 1, **body: Any) -> list[dict[str, Any]]:
        r = await self.http.post(
            f"/runs/{run_id}/sessions", json={"count": count, **body}, headers=ADMIN
        )
        assert r.status_code == 201, r.text
        out: list[dict[str, Any]] = r.json()["sessions"]
        return out

    async def chat(self, s: dict[str, Any], messages: list[dict[str, Any]] | None = None) -> Any:
        r = await self.http.post(
            f"/sessions/{s['id']}/v1/chat/completions",
            json={"messages": messages or USER, "max_tokens": 4, "seed": 0},
            headers=bearer(s["api_key"]),
        )
        assert r.status_code == 200, r.text
        return r.json()


@asynccontextmanager
async def app_client(engine: LocalEngine, tiny_model: Path, url: str) -> AsyncIterator[App]:
    store = await Store.connect(url)
    components = tiny_components(engine, store, tiny_model)
    app = create_app(GatewaySettings(admin_token=ADMIN_TOKEN), components)
    try:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(
                transport=transport, base_url="http://gw", timeout=60
            ) as http:
                yield App(http, store, app)
    finally:
        await store.close()


def parse_prometheus(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out
