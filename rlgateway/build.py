"""`build_trainer`: one place that turns a run config into a `Trainer` (policy backend, a
reference or critic only where the algorithm reads one), for `rlgateway train`, `serve --train`
and the demo."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

from store import Store
from trainer.config import TrainConfig
from trainer.loop import Trainer
from trainer.publish import WeightPublisher


def model_dir_of(cfg: TrainConfig, fallback: str | None = None) -> Path:
    """The initial policy: the config's `model`, else `fallback`, else the tiny model."""
    from engines.tiny_model import tiny_model_dir

    chosen = cfg.model or fallback
    return Path(chosen) if chosen else tiny_model_dir()


async def build_trainer(
    cfg: TrainConfig,
    store: Store,
    publisher: WeightPublisher | None,
    model_dir: Path,
    *,
    report: Callable[[dict[str, Any]], None] | None = None,
) -> Trainer:
    """The trainer of `cfg` on `model_dir`, resumed from its newest checkpoint. Models load in
    a worker thread, so a gateway on the same event loop keeps serving meanwhile."""
    from trainer.backends.registry import build_backend, build_value_backend

    algo = cfg.algorithm_config()
    backend = await asyncio.to_thread(build_backend, cfg.backend_config(str(model_dir)))
    reference = None
    if algo.needs_reference:
        reference = await asyncio.to_thread(build_backend, cfg.backend_config(str(model_dir)))
    critic = None
    if algo.use_critic:
        critic = await asyncio.to_thread(
            build_value_backend, cfg.critic_backend_config(str(model_dir))
        )
    trainer = Trainer(
        cfg, store, backend, publisher, reference=reference, critic=critic, report=report
    )
    try:
        await trainer.resume()
    except BaseException:
        trainer.close()
        raise
    return trainer
