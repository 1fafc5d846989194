"""The experiment client's admission order: while the run is at its staleness bound (429), the
groups waiting for sessions are admitted in the order they asked, whoever asks at the moment the
bound lifts. The gateway side is a stand-in that answers 429 until the test frees a slot, and
gives a freed slot to the first request that arrives after it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import httpx

from rlgateway.experiment.client import GatewayClient


class BoundedRun:
    """POST /runs/r/sessions: 429 (Retry-After 0) unless a slot is free; a free slot goes to
    whichever request comes first."""

    def __init__(self) -> None:
        self.free = 0
        self.admitted: list[str] = []
        self.asked: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        group = json.loads(request.content)["group_id"]
        self.asked.append(group)
        if self.free == 0:
            return httpx.Response(429, headers={"retry-after": "0"}, json={"error": "bound"})
        self.free -= 1
        self.admitted.append(group)
        sessions = [
            {"id": f"{group}-{i}", "group_id": group, "base_url": "x", "api_key": "k"}
            for i in range(2)
        ]
        return httpx.Response(200, json={"sessions": sessions})


async def _until(cond: Callable[[], bool]) -> None:
    async with asyncio.timeout(5.0):
        while not cond():
            await asyncio.sleep(0.001)


async def test_a_group_waiting_out_a_429_is_never_overtaken_by_a_later_one() -> None:
    # Each round frees one slot and, at that very moment, a new group asks for the first time
    # (the new group's request reaches the gateway long before the waiting groups retry). The
    # slot must still go to the group that has waited longest: rows of the data stream get
    # their sessions in stream order and none starves.
    run = BoundedRun()
    client = GatewayClient("http://gateway", "token", transport=httpx.MockTransport(run))
    try:
        tasks = [
            asyncio.create_task(client.sessions("r", 2, group_id="g0", metadata={})),
        ]
        await _until(lambda: "g0" in run.asked)
        for k in range(1, 6):
            run.free += 1
            tasks.append(
                asyncio.create_task(client.sessions("r", 2, group_id=f"g{k}", metadata={}))
            )
            await _until(lambda k=k: len(run.admitted) == k)  # type: ignore[misc]
        run.free += 1
        handles = await asyncio.gather(*tasks)
    finally:
        await client.close()
    assert run.admitted == [f"g{k}" for k in range(6)]
    assert [[h.id for h in hs] for hs in handles if hs] == [
        [f"g{k}-0", f"g{k}-1"] for k in range(6)
    ]
    assert client.admission_waits > 0


async def test_another_runs_groups_are_not_held_behind_this_runs_bound() -> None:
    # Admission order is per run: a run at its bound does not hold back the evaluation run.
    run = BoundedRun()

    def route(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/runs/eval/sessions":
            group = json.loads(request.content)["group_id"]
            return httpx.Response(
                200,
                json={
                    "sessions": [{"id": group, "group_id": group, "base_url": "x", "api_key": "k"}]
                },
            )
        return run(request)

    client = GatewayClient("http://gateway", "token", transport=httpx.MockTransport(route))
    stop = asyncio.Event()
    try:
        waiting = asyncio.create_task(
            client.sessions("r", 2, group_id="g0", metadata={}, stop=stop)
        )
        await _until(lambda: "g0" in run.asked)
        evaluated = await asyncio.wait_for(
            client.sessions("eval", 1, group_id="e0", metadata={}), 5.0
        )
        assert evaluated is not None
        assert evaluated[0].id == "e0"
        stop.set()
        assert await asyncio.wait_for(waiting, 5.0) is None
    finally:
        await client.close()
