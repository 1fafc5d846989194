"""The experiment's side of the gateway's public HTTP API: runs, sessions, rewards, ends, metrics.

Only public HTTP, exactly what a user's harness would send, so an experiment drives a remote
deployment (`--gateway-url`) the same way it drives the one it starts itself.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

import httpx

MIN_RETRY_SECONDS = 0.05
"""A 429's shortest wait: the staleness bound lifts when the trainer publishes a version."""


@dataclass(frozen=True, slots=True)
class SessionHandle:
    """A session as POST /runs/{id}/sessions made it."""

    id: str
    group_id: str | None
    base_url: str
    api_key: str


class GatewayClient:
    def __init__(
        self,
        url: str,
        admin_token: str,
        *,
        connections: int = 256,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.http = httpx.AsyncClient(
            base_url=self.url,
            transport=transport,
            headers={"Authorization": f"Bearer {admin_token}"},
            timeout=httpx.Timeout(600.0, connect=30.0),
            limits=httpx.Limits(max_connections=connections, max_keepalive_connections=64),
        )
        self.admission_waits = 0
        """429s answered by waiting: how often the staleness bound held rollouts back."""
        self._admission: dict[str, asyncio.Lock] = {}
        """Per run, groups are admitted in the order they asked (asyncio's lock is first come,
        first served): a group waiting out a 429 is never overtaken by a later one, so the rows of
        the data stream get sessions in stream order and none starves."""

    async def close(self) -> None:
        await self.http.aclose()

    async def create_run(self, name: str, config: dict[str, Any]) -> str:
        r = await self.http.post("/runs", json={"name": name, "config": config})
        _check(r)
        return str(r.json()["id"])

    async def version(self) -> int:
        """The policy version the gateway serves now."""
        r = await self.http.get("/admin/version")
        _check(r)
        return int(r.json()["version"])

    async def get_run(self, run_id: str) -> dict[str, Any]:
        r = await self.http.get(f"/runs/{run_id}")
        _check(r)
        out: dict[str, Any] = r.json()
        return out

    async def sessions(
        self,
        run_id: str,
        count: int,
        *,
        group_id: str,
        metadata: dict[str, Any],
        stop: asyncio.Event | None = None,
    ) -> list[SessionHandle] | None:
        """`count` new sessions of one group; while the run is at its staleness bound (429) it
        waits as Retry-After says and asks again, ahead of every group that asked later. None
        when `stop` is set meanwhile."""
        body = {"count": count, "group_id": group_id, "metadata": metadata}
        async with self._admission.setdefault(run_id, asyncio.Lock()):
            while stop is None or not stop.is_set():
                r = await self.http.post(f"/runs/{run_id}/sessions", json=body)
                if r.status_code == 429:
                    self.admission_waits += 1
                    wait = float(r.headers.get("retry-after", "1"))
                    await _sleep_or_stop(max(MIN_RETRY_SECONDS, min(wait, 1.0)), stop)
                    continue
                _check(r)
                return [
                    SessionHandle(s["id"], s["group_id"], s["base_url"], s["api_key"])
                    for s in r.json()["sessions"]
                ]
        return None

    async def reward(self, session_id: str, value: float, completion_id: str | None = None) -> None:
        body: dict[str, Any] = {"reward": value}
        if completion_id is not None:
            body["completion_id"] = completion_id
        _check(await self.http.post(f"/sessions/{session_id}/reward", json=body))

    async def end(self, session_id: str, failure: str | None = None) -> dict[str, Any]:
        """End the session; with `failure`, as failed with that reason (never trained; its
        group is judged without it). 409 when the trainer already took it is returned as
        `{"conflict": ...}`: it keeps what it was trained as."""
        if failure is None:
            r = await self.http.post(f"/sessions/{session_id}/end")
        else:
            r = await self.http.post(f"/sessions/{session_id}/end", json={"failure": failure[:500]})
        if r.status_code == 409:
            return {"conflict": r.json()}
        _check(r)
        out: dict[str, Any] = r.json()
        return out

    async def all_sessions(self, run_id: str, status: str | None = None) -> list[dict[str, Any]]:
        """Every session of the run (summaries, with metadata, status and outcome); with
        `status` ("active" or "ended"), only those."""
        out: list[dict[str, Any]] = []
        offset: int | None = 0
        while offset is not None:
            params: dict[str, Any] = {"limit": 500, "offset": offset}
            if status is not None:
                params["status"] = status
            r = await self.http.get(f"/runs/{run_id}/sessions", params=params)
            _check(r)
            page = r.json()
            out += page["sessions"]
            offset = page["next_offset"]
        return out

    async def metrics(self, run_id: str, after: int | None = None) -> list[dict[str, Any]]:
        """The trainer's step rows after step `after`, one dict per step."""
        params = {"after": after} if after is not None else {}
        r = await self.http.get(f"/runs/{run_id}/metrics", params=params)
        _check(r)
        data = r.json()
        rows = []
        for i, step in enumerate(data["steps"]):
            row = {k: v[i] for k, v in data["series"].items() if v[i] is not None}
            rows.append({"step": step, **row})
        return rows


class GatewayError(RuntimeError):
    """The gateway refused a request the experiment made (its status and body)."""


def _check(r: httpx.Response) -> None:
    if r.is_success:
        return
    raise GatewayError(f"{r.request.method} {r.request.url.path}: {r.status_code} {r.text[:500]}")


async def _sleep_or_stop(seconds: float, stop: asyncio.Event | None) -> None:
    if stop is None:
        await asyncio.sleep(seconds)
        return
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
