"""`rlgateway serve --train`: the trainer as a background task of the gateway's process.

It claims trajectories from the same store, trains with the FSDP backend (one process), and
publishes each new policy straight into the local engine; agents keep generating meanwhile, and
tokens sampled after a swap carry the new version.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.app import Components
    from gateway.settings import GatewaySettings
    from trainer.config import TrainConfig
    from trainer.loop import Trainer

log = logging.getLogger(__name__)


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
        from engines.tiny_model import tiny_model_dir
        from trainer.backends.registry import build_backend, build_value_backend
        from trainer.loop import Trainer
        from trainer.publish import LocalPublisher

        if not cfg.run:
            run = await c.store.create_run(
                "embedded", cfg.model_dump(mode="json", exclude={"run", "database_url"})
            )
            cfg = cfg.model_copy(update={"run": run.id})
            key = await c.store.new_run_key(run.id)
            print(
                f"training run {run.id} (create its sessions with POST /runs/{run.id}/sessions; "
                f"the run's agent key: {key})"
            )
        model_dir = cfg.model or settings.model or str(tiny_model_dir())
        backend = await asyncio.to_thread(build_backend, cfg.backend_config(str(Path(model_dir))))
        reference = None
        if cfg.algorithm_config().kl_coef > 0:
            reference = await asyncio.to_thread(
                build_backend, cfg.backend_config(str(Path(model_dir)))
            )
        critic = None
        if cfg.algorithm_config().use_critic:
            critic = await asyncio.to_thread(
                build_value_backend, cfg.critic_backend_config(str(Path(model_dir)))
            )
        trainer = Trainer(
            cfg,
            c.store,
            backend,
            LocalPublisher(c.engine),
            reference=reference,
            critic=critic,
            report=report,
        )
        await trainer.resume()
        stop = asyncio.Event()
        task = asyncio.create_task(trainer.run(stop), name="rlgateway-trainer")
        task.add_done_callback(_log_failure)
        return cls(trainer, task, stop)

    async def stop(self) -> None:
        self._stop.set()
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self.trainer.close()


def _log_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the embedded trainer stopped", exc_info=task.exception())
