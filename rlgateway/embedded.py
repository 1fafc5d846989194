"""`rlgateway serve --train` and the demo: the trainer as a background task of the gateway's
process.

It claims trajectories from the same store, trains with the FSDP backend (one process), and
publishes each new policy straight into the local engine (recorded in the store as the newest
published policy, without a directory); agents keep generating meanwhile, and tokens sampled
after a swap carry the new version. `serve --train run=ID` merges its config with the run's
first (`rlgateway.run_merge`, in `rlgateway serve`); without a run it creates one with its config.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from gateway.deps import Components
from gateway.settings import GatewaySettings
from rlgateway.build import build_publisher, build_trainer, model_dir_of
from rlgateway.run_merge import stored_form
from store import Store
from trainer.collective import EngineSink
from trainer.config import TrainConfig
from trainer.loop import Trainer
from trainer.publish import LocalPublisher, WeightPublisher
from trainer.weights import Weights

log = logging.getLogger(__name__)


class RecordingPublisher:
    """A publisher that records each version it makes the engine serve as the newest published
    policy, with no directory (`Store.record_policy`): in-process weights cannot be loaded
    again by a restarted gateway, which says so and serves its model until the trainer
    resumes."""

    def __init__(self, inner: WeightPublisher, store: Store) -> None:
        self.inner = inner
        self.store = store

    async def publish(self, weights: Weights, version: int) -> int:
        before = await self.inner.served()
        served = await self.inner.publish(weights, version)
        if served != before:
            await self.store.record_policy(served, None)
        return served

    async def served(self) -> int:
        return await self.inner.served()


class EmbeddedTrainer:
    def __init__(self, trainer: Trainer, task: asyncio.Task[None], stop_event: asyncio.Event):
        self.trainer = trainer
        self.task = task
        self._stop = stop_event

    @classmethod
    async def start(
        cls,
        cfg: TrainConfig,
        c: Components,
        settings: GatewaySettings,
        *,
        report: Callable[[dict[str, Any]], None] | None = None,
    ) -> EmbeddedTrainer:
        """Start training `cfg.run` (a new run when empty); `report` receives each step's
        metrics (default: a line on stdout)."""
        if not cfg.run:
            run = await c.store.create_run("embedded", stored_form(cfg))
            cfg = cfg.model_copy(update={"run": run.id})
            key = await c.store.new_run_key(run.id)
            print(
                f"training run {run.id} (create its sessions with POST /runs/{run.id}/sessions; "
                f"the run's agent key: {key})"
            )
        model_dir = model_dir_of(cfg, settings.model)
        sink = EngineSink(c.engine) if cfg.publish.mode == "collective" else None
        inner = build_publisher(cfg, LocalPublisher(c.engine), sink)
        publisher = RecordingPublisher(inner, c.store)
        # resumed (its checkpoint's version published) before this returns: the sidecar of
        # `serve --train` is entered in the gateway's startup, before any session is admitted
        trainer = await build_trainer(cfg, c.store, publisher, model_dir, report=report)
        stop = asyncio.Event()
        task = asyncio.create_task(trainer.run(stop), name="rlgateway-trainer")
        task.add_done_callback(_log_failure)
        return cls(trainer, task, stop)

    async def stop(self) -> None:
        self._stop.set()
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self.trainer.close()


def embedded_trainer(
    cfg: TrainConfig,
) -> Callable[[Components, GatewaySettings], Any]:
    """A gateway sidecar (`gateway.app.Sidecar`) that trains `cfg` for the app's lifetime."""

    @asynccontextmanager
    async def sidecar(c: Components, settings: GatewaySettings) -> AsyncIterator[EmbeddedTrainer]:
        trainer = await EmbeddedTrainer.start(cfg, c, settings)
        try:
            yield trainer
        finally:
            await trainer.stop()

    return sidecar


def _log_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the embedded trainer stopped", exc_info=task.exception())
