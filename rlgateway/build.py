"""`build_trainer`: one place that turns a run config into a `Trainer` (policy backend, a
reference or critic only where the algorithm reads one), for `rlgateway train`, `serve --train`
and the demo."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from store import Store
from trainer.config import TrainConfig
from trainer.loop import Trainer
from trainer.publish import WeightPublisher
from trainer.torch_thread import on_torch_thread

if TYPE_CHECKING:
    from trainer.collective import GroupSink


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
    backend = await on_torch_thread(build_backend, cfg.backend_config(str(model_dir)))
    reference = None
    if algo.needs_reference:
        reference = await on_torch_thread(build_backend, cfg.backend_config(str(model_dir)))
    critic = None
    if algo.use_critic:
        critic = await on_torch_thread(
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


def build_publisher(
    cfg: TrainConfig, fallback: WeightPublisher, sink: GroupSink | None = None
) -> WeightPublisher:
    """`fallback` (the disk path, or the in-process engine), behind the weight group when
    `cfg.publish.mode` is collective (`trainer.collective`; `sink` is the gateway's half)."""
    p = cfg.publish
    if p.mode == "disk":
        return fallback
    import torch

    from trainer.collective import CollectivePublisher

    if sink is None:
        raise ValueError("publish.mode collective needs a gateway: give --gateway-url")
    backend = p.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    return CollectivePublisher(
        sink,
        fallback,
        master_address=p.master_address,
        backend=backend,
        bucket_bytes=p.bucket_bytes,
        timeout_s=p.timeout_s,
    )
