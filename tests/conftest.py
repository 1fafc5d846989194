"""Fixtures shared by every tier. The tiny model is built once per machine (cached on disk)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["tests.store_fixtures"]


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The test-sized tiny Qwen2 model directory (built on first use, then cached)."""
    from engines.tiny_model import tiny_model_dir

    return tiny_model_dir(size="test", seed=0)


@pytest.fixture(scope="session")
def tiny_moe_model() -> Path:
    """The test-sized tiny Qwen3-MoE model directory (built on first use, then cached)."""
    from engines.tiny_model import tiny_model_dir

    return tiny_model_dir(size="test", seed=0, moe=True)
