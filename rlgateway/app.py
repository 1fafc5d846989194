"""The gateway as `rlgateway serve` composes it: the HTTP service of `gateway/` with the
trainer's run-config check, and (`serve --train`) the trainer as a sidecar in the same process."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI

from gateway.app import Sidecar
from gateway.app import create_app as create_gateway_app
from gateway.deps import Components
from gateway.settings import GatewaySettings
from trainer.config import check_run_config

if TYPE_CHECKING:
    from trainer.config import TrainConfig


def create_app(
    settings: GatewaySettings,
    components: Components | None = None,
    *,
    train: TrainConfig | None = None,
) -> FastAPI:
    """`train` runs the trainer in this process, publishing each new policy straight into the
    engine (`rlgateway serve --train`)."""
    sidecars: list[Sidecar] = []
    if train is not None:
        from rlgateway.embedded import embedded_trainer

        sidecars.append(embedded_trainer(train))
    return create_gateway_app(
        settings, components, check_run_config=check_run_config, sidecars=sidecars
    )
