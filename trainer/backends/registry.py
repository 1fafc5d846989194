"""Builds a training backend from its config through an explicit registry."""

from __future__ import annotations

from collections.abc import Callable

from trainer.backends.base import TrainBackend
from trainer.backends.config import BackendConfig
from trainer.backends.fsdp import FSDPBackend

BACKEND_CLASSES: dict[str, Callable[..., TrainBackend]] = {"fsdp": FSDPBackend}
"""Backend classes by config `type`; each takes its config's fields (less `type`) as arguments."""


def build_backend(config: BackendConfig) -> TrainBackend:
    """The backend that `config.type` names, constructed from the config's fields."""
    return BACKEND_CLASSES[config.type](**config.model_dump(exclude={"type"}))
