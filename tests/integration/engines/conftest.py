"""Fixtures of the engine integration tests that several modules share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.gateway_server import GatewayHandle, run_gateway


@pytest.fixture(scope="module")
def gateway(
    tiny_model: Path, vllm_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayHandle]:
    """`rlgateway serve --engine vllm` on the session's vLLM server (one per module)."""
    args = ["--engine", "vllm", "--engine-url", vllm_url]
    with run_gateway(tiny_model, tmp_path_factory.mktemp("gw-vllm"), extra_args=args) as gw:
        yield gw
