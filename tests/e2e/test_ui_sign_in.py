"""The page's answers arriving out of order, in headless Chromium against a real `rlgateway
serve`: responses are held back with Playwright's request routing and released at the worst
moment. A refusal of a wrong token that arrives after the right one was entered leaves the user
signed in (CI once saw the page fall back to its sign-in form after the user's first click), and
a page whose route was overtaken while it waited draws nothing over the newer one."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.browser import CHROMIUM, CHROMIUM_ARGS
from tests.support.gateway_server import run_gateway

pytestmark = pytest.mark.slow


@pytest.fixture
def browser() -> Iterator[Any]:
    if not CHROMIUM.exists():
        message = "needs Debian's chromium at /usr/bin/chromium: apt-get install -y chromium"
        if os.environ.get("RLGATEWAY_REQUIRE_CHROMIUM"):  # CI installs it: missing is a failure
            pytest.fail(message)
        pytest.skip(message)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


def _hold(page: Any, pattern: str, when: Callable[[Any], bool]) -> list[Any]:
    """Holds back the page's requests to `pattern` that `when` picks (the rest go through);
    the list they collect in."""
    held: list[Any] = []

    def handle(route: Any) -> None:
        if when(route.request):
            held.append(route)
        else:
            route.continue_()

    page.route(pattern, handle)
    return held


def _release(page: Any, pattern: str, held: list[Any]) -> Any:
    """Answers the one request held back, then lets the page run what the response sets off
    (its body read, its handlers); the response."""
    assert len(held) == 1
    with page.expect_response(pattern) as late:
        held[0].continue_()
    late.value.finished()
    page.evaluate("() => new Promise((done) => setTimeout(done, 100))")
    return late.value


@pytest.fixture
def ui(tiny_model: Path, tmp_path: Path, browser: Any) -> Iterator[tuple[Any, Any]]:
    """A real gateway and a fresh page in the browser: (gateway, page)."""
    with run_gateway(tiny_model, tmp_path) as gw:
        page = browser.new_page()
        page.set_default_timeout(20_000)
        yield gw, page


def test_a_late_refusal_of_a_wrong_token_keeps_the_right_one(ui: tuple[Any, Any]) -> None:
    from playwright.sync_api import expect

    gw, page = ui
    run_id = gw.create_run("sign-in")
    # the wrong token's second request is answered later, after the right token is in
    held = _hold(page, "**/engines", lambda r: r.headers.get("authorization") == "Bearer wrong")
    page.goto(f"{gw.url}/ui")
    page.get_by_test_id("token").fill("wrong")
    page.get_by_test_id("token-submit").click()
    expect(page.get_by_test_id("login-error")).to_contain_text("refused")  # /runs refused it
    page.get_by_test_id("token").fill(gw.admin_token)
    page.get_by_test_id("token-submit").click()
    row = page.locator(f'[data-testid="run-row"][data-run="{run_id}"]')
    expect(row).to_contain_text("sign-in")

    assert _release(page, "**/engines", held).status == 401
    # still signed in: the refusal was of the token the page no longer holds
    assert page.evaluate("sessionStorage.getItem('rlgateway.adminToken')") == gw.admin_token
    expect(page.get_by_test_id("login")).to_be_hidden()
    row.click()
    expect(page.get_by_test_id("run-id")).to_have_text(run_id)


def test_a_page_overtaken_by_a_newer_route_draws_nothing(ui: tuple[Any, Any]) -> None:
    from playwright.sync_api import expect

    gw, page = ui
    run_id = gw.create_run("overtaken")
    held = _hold(page, f"**/runs/{run_id}", lambda r: True)  # the run page's first request
    page.goto(f"{gw.url}/ui#token={gw.admin_token}")
    row = page.locator(f'[data-testid="run-row"][data-run="{run_id}"]')
    with page.expect_request(f"**/runs/{run_id}"):
        row.click()
    page.evaluate("() => { location.hash = '#/'; }")  # back to the list before it answers
    expect(row).to_be_visible()

    _release(page, f"**/runs/{run_id}", held)
    # the list stays: the run page's answer came for a route the user had left
    expect(row).to_be_visible()
    expect(page.get_by_test_id("run-id")).to_have_count(0)
