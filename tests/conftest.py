"""Fixtures shared by every tier. The tiny model is built once per machine (cached on disk).

CI runs the suite on two pytest-xdist workers (`.ci/run`: `-n 2 --dist loadgroup`); every test
that runs vLLM goes to one worker (`VLLM_GROUP`), so the session's server serves them all and no
two modules start servers at once. Everything else a test starts (ports, databases, model caches,
directories) is private to it or safe for concurrent processes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["tests.store_fixtures"]

VLLM_GROUP = "vllm"
"""The xdist group of every test that runs vLLM: the session's server (`vllm_url`) and the
servers of the `vllm`-marked modules run on one worker, one or two at a time, not four at once
over two cores."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under xdist, send every vLLM test to one worker (`--dist loadgroup`)."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        if "vllm_url" in getattr(item, "fixturenames", ()) or item.get_closest_marker("vllm"):
            item.add_marker(pytest.mark.xdist_group(VLLM_GROUP))


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
