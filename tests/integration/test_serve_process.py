"""`rlgateway serve` as an operator runs it: what it prints, and how it stops."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.settings import GatewaySettings
from rlgateway.commands.serve import _page_line
from tests.integration.gateway_server import run_gateway

pytestmark = pytest.mark.slow


def test_serve_prints_the_page_and_a_sigterm_is_a_clean_shutdown(
    tiny_model: Path, tmp_path: Path
) -> None:
    """The test harness stops the server as a service manager does: SIGTERM to the whole
    process group, the engine process included. The gateway shuts the engine down itself."""
    with run_gateway(tiny_model, tmp_path) as gw:
        assert gw.client.get("/health").json()["ok"] is True
        url = gw.url
    log = gw.log_path.read_text()
    assert f"web page: {url}/ui (give it the admin token" in log
    assert gw.admin_token not in log  # a token the operator chose is not repeated
    assert " ERROR " not in log, log
    assert "exited with code" not in log, log


def test_a_made_up_token_comes_with_a_link_that_signs_the_page_in() -> None:
    settings = GatewaySettings(admin_token="rlg-admin-abc", port=8123)
    assert _page_line(settings, made_up=True) == (
        "web page: http://127.0.0.1:8123/ui#token=rlg-admin-abc"
    )
    assert "rlg-admin-abc" not in _page_line(settings, made_up=False)
