"""`rlgateway serve` as an operator runs it: what it prints, and how it stops."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import httpx
import pytest

from gateway.settings import GatewaySettings
from rlgateway.commands.serve import _page_line
from tests.support.gateway_server import run_gateway

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


def test_a_connection_that_never_completes_its_request_head_is_closed(
    tiny_model: Path, tmp_path: Path
) -> None:
    """uvicorn alone keeps such a connection forever (slowloris); the gateway gives each request
    head `header_timeout` seconds, from the connection's opening or the previous response, and a
    response that takes longer than that is not cut."""
    env = {"RLGATEWAY_HEADER_TIMEOUT": "0.5"}
    with run_gateway(tiny_model, tmp_path, extra_env=env) as gw:
        host, port = gw.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as slow:
            slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never finished
            t0 = time.monotonic()
            assert slow.recv(1024) == b""  # closed by the server
            assert 0.4 < time.monotonic() - t0 < 5
        with socket.create_connection((host, int(port)), timeout=10) as kept:
            kept.sendall(b"GET /health/live HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = b""
            while not answer.endswith(b'{"ok":true}'):  # the whole response, head and body
                part = kept.recv(4096)
                assert part, answer
                answer += part
            assert answer.startswith(b"HTTP/1.1 200")
            kept.sendall(b"GET /health HTTP/1.1\r\n")  # the next head, trickled: closed too
            assert kept.recv(1024) == b""
        # a generation that outlasts the deadline is answered whole
        session = gw.new_session()
        r = httpx.post(
            f"{session['base_url']}/chat/completions",
            headers={"Authorization": f"Bearer {session['api_key']}"},
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1900,
                  "ignore_eos": True, "stream": True},
            timeout=120,
        )  # fmt: skip
        assert r.status_code == 200
        assert r.text.rstrip().endswith("data: [DONE]")
        assert r.elapsed.total_seconds() > 0.5


def test_a_made_up_token_comes_with_a_link_that_signs_the_page_in() -> None:
    settings = GatewaySettings(admin_token="rlg-admin-abc", port=8123)
    assert _page_line(settings, made_up=True) == (
        "web page: http://127.0.0.1:8123/ui#token=rlg-admin-abc"
    )
    assert "rlg-admin-abc" not in _page_line(settings, made_up=False)
