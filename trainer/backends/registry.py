"""Builds a training backend from its config through an explicit registry."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trainer.backends.archon import ArchonBackend, ArchonValueBackend
from trainer.backends.base import TrainBackend, ValueBackend
from trainer.backends.config import BackendConfig
from trainer.backends.fsdp import FSDPBackend
from trainer.backends.fsdp_value import FSDPValueBackend
from trainer.backends.megatron import MegatronBackend

BACKEND_CLASSES: dict[str, Callable[..., TrainBackend]] = {
    "fsdp": FSDPBackend,
    "archon": ArchonBackend,
    "megatron": MegatronBackend,
}
"""Backend classes by config `type`; each takes its config's fields (less `type`) as arguments."""

VALUE_BACKEND_CLASSES: dict[str, Callable[..., ValueBackend]] = {
    "fsdp": FSDPValueBackend,
    "archon": ArchonValueBackend,
}
"""Value-model (critic) backends by config `type`, constructed the same way."""


def build_backend(config: BackendConfig) -> TrainBackend:
    """The backend that `config.type` names, constructed from the config's fields."""
    return BACKEND_CLASSES[config.type](**_arguments(config))


def build_value_backend(config: BackendConfig) -> ValueBackend:
    """The critic that `config.type` names: the policy architecture with a scalar value head,
    initialised from `config.model_dir`."""
    return VALUE_BACKEND_CLASSES[config.type](**_arguments(config))


def _arguments(config: BackendConfig) -> dict[str, Any]:
    """The config's fields (less `type`) as constructor arguments; nested models stay models."""
    return {name: value for name, value in config if name != "type"}
