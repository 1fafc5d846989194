"""The router's re-sync knobs change what happens to a server that cannot take the weights:
`resync_timeout` bounds one attempt, `resync_backoff_max` caps the wait between attempts.
Stub engines (no server): what is under test is the router's bookkeeping."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Literal

import pytest

from engines.base import EngineHealth, GenerateRequest, TokenChunk, WeightUpdate
from engines.errors import WeightUpdateError
from engines.router import Router


class Stub:
    """An engine that answers probes at `served` and takes updates as `mode` says."""

    def __init__(self, mode: Literal["ok", "hang", "fail"] = "ok") -> None:
        self.served = 0
        self.mode = mode
        self.attempts = 0

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        raise NotImplementedError

    async def abort(self, request_id: str) -> None:
        pass

    async def pause(self) -> None:
        pass

    async def resume(self) -> None:
        pass

    async def update_weights(self, update: WeightUpdate) -> int:
        self.attempts += 1
        if self.mode == "hang":
            await asyncio.sleep(3600)
        if self.mode == "fail":
            raise WeightUpdateError("cannot take them")
        assert update.version is not None
        self.served = update.version
        return self.served

    def version(self) -> int:
        return self.served

    async def health(self) -> EngineHealth:
        return EngineHealth(ok=True, paused=False, version=self.served, running=0, waiting=0)

    async def close(self) -> None:
        pass


async def router_with_a_lagging_server(
    mode: Literal["hang", "fail"], **knobs: float
) -> tuple[Router, Stub]:
    good, bad = Stub(), Stub()
    router = Router([("good", good), ("bad", bad)], health_interval=0.01, **knobs)
    bad.mode = "fail"
    assert await router.update_weights(WeightUpdate(path=Path("/weights"))) == 1
    bad.mode = mode  # `bad` missed version 1 and is lagging from now on
    return router, bad


@pytest.mark.parametrize(("limit_s", "bounded"), [(0.1, True), (30.0, False)])
async def test_resync_timeout_bounds_one_attempt(limit_s: float, bounded: bool) -> None:
    router, bad = await router_with_a_lagging_server("hang", resync_timeout=limit_s)
    try:
        await asyncio.wait_for(router.check(), 2.0)
    except TimeoutError:
        assert not bounded, "the attempt was to end at resync_timeout"
    else:
        assert bounded, "an attempt without a bound cannot have ended"
        state = router.backends[1].state()
        assert (state.state, state.version) == ("stale", 0)
        assert "re-sync to version 1 failed" in state.detail
    assert bad.attempts == 2  # the missed update, then one re-sync
    await router.close()


@pytest.mark.parametrize("cap", [0.05, 10.0])
async def test_resync_backoff_max_caps_the_wait_between_attempts(cap: float) -> None:
    router, bad = await router_with_a_lagging_server("fail", resync_backoff_max=cap)
    b = router.backends[1]
    for _ in range(8):
        b.resync_at = 0.0  # the wait is over: try again now
        await router.check()
    assert bad.attempts == 9
    # the delay doubles from the health interval (0.01 s) after each failure, up to the cap
    assert b.resync_delay == pytest.approx(min(0.01 * 2**7, cap))
    assert b.state().state == "stale"
    await router.close()
