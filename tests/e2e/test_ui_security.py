"""The page under its own Content-Security-Policy, in headless Chromium against a real
`rlgateway serve`: every view renders with nothing refused (no inline script or style; the
legend and the tokens are coloured through the CSSOM), and an id taken from the address bar is
one encoded path segment, so a crafted hash route cannot aim the admin token at another route."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from tests.support.browser import CHROMIUM, CHROMIUM_ARGS
from tests.support.gateway_server import run_gateway

pytestmark = pytest.mark.slow


def test_the_page_runs_within_its_csp_and_encodes_ids_into_paths(
    tiny_model: Path, tmp_path: Path
) -> None:
    if not CHROMIUM.exists():
        message = "needs Debian's chromium at /usr/bin/chromium: apt-get install -y chromium"
        if os.environ.get("RLGATEWAY_REQUIRE_CHROMIUM"):
            pytest.fail(message)
        pytest.skip(message)
    from playwright.sync_api import expect, sync_playwright

    with run_gateway(tiny_model, tmp_path) as gw:
        run_id = gw.create_run("csp")
        s = gw.new_session(run_id=run_id)
        r = httpx.post(
            f"{s['base_url']}/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            headers={"Authorization": f"Bearer {s['api_key']}"},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        with sync_playwright() as p:
            browser = p.chromium.launch(
                executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True
            )
            try:
                page = browser.new_page()
                page.set_default_timeout(20_000)
                console: list[str] = []
                page.on("console", lambda m: console.append(m.text))
                paths: list[str] = []
                page.on("request", lambda req: paths.append(urlsplit(req.url).path))

                page.goto(f"{gw.url}/ui#token={gw.admin_token}")
                page.locator(f'[data-testid="run-row"][data-run="{run_id}"]').click()
                expect(page.get_by_test_id("chart-reward_mean")).to_be_visible()
                page.locator(f'[data-testid="session-row"][data-session="{s["id"]}"]').click()
                expect(page.get_by_test_id("segment")).to_have_count(1)
                legend = page.locator(".legend .tok.sampled").first
                colour = legend.evaluate("e => getComputedStyle(e).backgroundColor")
                assert colour not in ("", "rgba(0, 0, 0, 0)")  # coloured, not refused
                token = page.locator('[data-testid="segment"] .tok.sampled').first
                assert "background" in (token.get_attribute("style") or "")

                # ids from the address bar stay one path segment each
                paths.clear()
                page.goto(f"{gw.url}/ui#/runs/..%2Fadmin%2Fversion")
                expect(page.get_by_test_id("error")).to_be_visible()
                page.goto(f"{gw.url}/ui#/sessions/x%3Ftexts%3Dfalse")
                expect(page.get_by_test_id("error")).to_be_visible()
                api = [x for x in paths if not x.startswith("/ui")]
                assert "/runs/..%2Fadmin%2Fversion" in api, api
                assert "/sessions/x%3Ftexts%3Dfalse" in api, api
                assert "/admin/version" not in api
            finally:
                browser.close()
        refused = [m for m in console if "Content Security Policy" in m]
        assert refused == [], refused
