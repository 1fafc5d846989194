"""The run-owned settings (`store.run_config.RunConfig`) of the runs the gateway serves, cached.

Every recorded request samples under its run's config (`gateway.core.sampling`), so the config must
not cost a query per request: `RunConfigs.of` keeps each run's for `ttl` seconds (5 by default)
and loads it once however many requests ask at the same moment. Nothing in this gateway changes
a stored run config (`POST /runs` sets it when it creates the run; no route changes it), so the
cache can go stale only by a change another process writes to the store: a trainer adopting the
run (`rlgateway train`, `rlgateway.run_merge`, `Store.set_run_config`). This gateway sees such a
change within `ttl` seconds; a turn sampled in between records the settings it really used, so
the trainer still reproduces it. A run deleted elsewhere answers 404 once its entry expires.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable

from store import Store
from store.run_config import RunConfig, run_config_of

DEFAULT_TTL = 5.0
"""Seconds a run's config is served from the cache before it is read again."""


def discount_of(cfg: RunConfig, fallback: float) -> float:
    """The run's discount gamma; `fallback` (the gateway's setting) when its stored config sets
    none (`run_config_of` validates only the keys present, so `model_fields_set` says which)."""
    return cfg.discount if "discount" in cfg.model_fields_set else fallback


class RunConfigs:
    """Run id -> its `RunConfig`, each read at most once per `ttl` (module docstring)."""

    def __init__(
        self,
        store: Store,
        *,
        ttl: float = DEFAULT_TTL,
        max_entries: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.ttl = ttl
        self.max_entries = max_entries
        self.clock = clock
        self._entries: dict[str, tuple[float, RunConfig]] = {}
        """run id -> (when it expires, its config)"""
        self._loading: dict[str, asyncio.Task[RunConfig]] = {}

    async def of(self, run_id: str) -> RunConfig:
        """The run's config (raises the store's NotFoundError for a run that does not exist)."""
        hit = self._entries.get(run_id)
        if hit is not None and hit[0] > self.clock():
            return hit[1]
        task = self._loading.get(run_id)
        if task is None:
            task = asyncio.create_task(self._load(run_id), name=f"run-config-{run_id}")
            self._loading[run_id] = task
            task.add_done_callback(functools.partial(self._loaded, run_id))
        # shielded: a request that is cancelled (its client left) does not cancel the load that
        # other requests wait on
        return await asyncio.shield(task)

    async def _load(self, run_id: str) -> RunConfig:
        run = await self.store.get_run(run_id)
        cfg = run_config_of(run.config)
        if len(self._entries) >= self.max_entries:
            self._entries.clear()
        self._entries[run_id] = (self.clock() + self.ttl, cfg)
        return cfg

    def _loaded(self, run_id: str, task: asyncio.Task[RunConfig]) -> None:
        del self._loading[run_id]
        if not task.cancelled():
            task.exception()  # retrieved here, so a failure nobody waited for is not logged
