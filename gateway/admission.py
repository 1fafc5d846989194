"""Staleness admission (AReaL): a new session is admitted only while it cannot push training data
past the staleness bound eta.

    capacity = min(max_concurrent - running, (eta + v + 1) * B - (accepted + running))

with v the current policy version, B the trajectories per training step, `running` the run's
active sessions and `accepted` its ended, rewarded sessions the trainer did not drop. eta = 0 is
synchronous RL: one batch of sessions per policy version. A run whose config sets neither `eta`
nor `batch_size` is not throttled.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict

from gateway.errors import TooManyRequests
from store import Store
from store.run_config import run_config_of, throttled
from store.types import Run


def capacity(
    *,
    version: int,
    running: int,
    accepted: int,
    eta: int,
    batch_size: int,
    max_concurrent: int | None,
) -> int:
    stale_room = (eta + version + 1) * batch_size - (accepted + running)
    if max_concurrent is None:
        return stale_room
    return min(max_concurrent - running, stale_room)


class Admission:
    def __init__(self, store: Store) -> None:
        self.store = store
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)

    def lock(self, run_id: str) -> asyncio.Lock:
        """Held around check + create so concurrent requests cannot both take the last slot."""
        return self._locks[run_id]

    async def check(self, run: Run, count: int, version: int) -> None:
        if not throttled(run.config):
            return
        cfg = run_config_of(run.config)
        running, accepted = await self.store.run_counts(run.id)
        room = capacity(
            version=version,
            running=running,
            accepted=accepted,
            eta=cfg.eta,
            batch_size=cfg.batch_size,
            max_concurrent=cfg.max_concurrent,
        )
        if count > room:
            raise TooManyRequests(
                f"run {run.id} is at its staleness bound (eta={cfg.eta}, policy version {version}, "
                f"{running} running, {accepted} finished, room for {max(room, 0)}): retry after "
                "the trainer publishes the next version",
                retry_after=1.0,
            )
