"""Fixtures shared by every tier. The tiny model is built once per machine (cached on disk).

CI runs the suite on two pytest-xdist workers (`.ci/run`: `-n 2 --dist loadgroup`), and sends
whole groups of tests to one worker: every test that runs vLLM (`VLLM_GROUP`), so the session's
server serves them all and no two modules start servers at once; and each module whose tests
share a module-scoped fixture (a gateway, a torchrun job, a database), so that it is built once
and not once per worker. Everything else goes test by test. Everything a test starts (ports,
databases, model caches, directories) is private to it or safe for concurrent processes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["tests.store_fixtures"]

VLLM_GROUP = "vllm"
"""The xdist group of every test that runs vLLM: the session's server (`vllm_url`) and the
servers of the `vllm`-marked modules run on one worker, one or two at a time, not four at once
over two cores."""


SHARED_SCOPES = {"module", "class", "package"}
"""Fixture scopes whose value the tests of one module share."""


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under xdist, group the tests that share what they start (`--dist loadgroup`). This runs
    first, before xdist's worker reads the `xdist_group` marks into the node ids it schedules by:
    after it, the marks come too late and each group's fixtures are built on both workers
    (`tests/unit/project/test_ci_grouping.py` holds both this and the pytest pin it needs)."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        group = xdist_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


def xdist_group(item: pytest.Item) -> str | None:
    """The group `item` runs in: vLLM's, the one its module names, its module's if it uses a
    fixture its module shares, else none (it goes wherever a worker is free)."""
    if "vllm_url" in getattr(item, "fixturenames", ()) or item.get_closest_marker("vllm"):
        return VLLM_GROUP
    if item.get_closest_marker("xdist_group"):
        return None  # a group its module names (the fleet tests: one fleet at a time)
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    for name in info.names_closure:
        defs = info.name2fixturedefs.get(name, ())
        if defs and defs[-1].scope in SHARED_SCOPES:
            return item.nodeid.split("::")[0]
    return None


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
