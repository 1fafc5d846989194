"""The page at /ui end to end in headless Chromium (Playwright driving Debian's `chromium`, never a
downloaded browser), against a real `rlgateway serve`: log in with the admin token, find the run
this test recorded, read its charts, open a trajectory (tokens coloured by logprob, tool output
and context told apart, version badges, a side request shown apart), pause the run and set a
reward, and check both in the API and the store; a link with the token in its fragment opens it
signed in."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from store import Store
from store.types import Outcome
from tests.support.browser import CHROMIUM, CHROMIUM_ARGS
from tests.support.gateway_server import run_gateway

pytestmark = pytest.mark.slow

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
        },
    }
]
TOOL_HISTORY = [
    {"role": "user", "content": "2+3?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "add", "arguments": json.dumps({"a": 2, "b": 3})},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "five"},
]


def record(gw: Any) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """A run with two recorded sessions (one with a tool result in its history, whose agent
    then ended it as failed; the other with a side request too) and three training steps in the
    store."""
    side = [{"name": "title", "header": "x-title-request"}]
    run_id = gw.create_run("ui-e2e", {"batch_size": 2, "group_size": 2, "side_requests": side})
    first, second = gw.new_sessions(2, run_id=run_id, group_id="g")
    for s, messages in ((first, TOOL_HISTORY), (second, [{"role": "user", "content": "hi"}])):
        r = httpx.post(
            f"{s['base_url']}/chat/completions",
            json={"messages": messages, "tools": TOOLS, "max_tokens": 8, "seed": 1},
            headers={"Authorization": f"Bearer {s['api_key']}"},
            timeout=60,
        )
        assert r.status_code == 200, r.text
    r = httpx.post(
        f"{second['base_url']}/chat/completions",
        json={"messages": [{"role": "user", "content": "a title?"}], "max_tokens": 4, "seed": 2},
        headers={"Authorization": f"Bearer {second['api_key']}", "x-title-request": "1"},
        timeout=60,
    )
    assert r.headers["x-rlgateway-side"] == "title", r.headers
    gw.client.post(f"/sessions/{second['id']}/reward", json={"reward": 0.5})
    r = gw.client.post(f"/sessions/{first['id']}/end", json={"failure": "grader raised"})
    assert r.status_code == 200, r.text

    async def steps() -> None:
        store = await Store.connect(gw.database_url)
        try:
            for step in (1, 2, 3):
                await store.record_step(
                    run_id,
                    step,
                    version=step,
                    metrics={
                        "reward_mean": 0.1 * step,
                        "loss": 1.0 / step,
                        "staleness_mean": 0.5,
                        "tokens_per_s": 100.0 * step,
                    },
                )
            # what the trainer made of the sessions: one left out by dynamic sampling
            await store.settle_consumed([second["id"]], step=-1, outcome=Outcome.FILTERED)
        finally:
            await store.close()

    asyncio.run(steps())
    return run_id, first, second


def test_page_shows_a_run_opens_a_trajectory_pauses_and_sets_a_reward(
    tiny_model: Path, tmp_path: Path
) -> None:
    if not CHROMIUM.exists():
        message = "needs Debian's chromium at /usr/bin/chromium: apt-get install -y chromium"
        if os.environ.get("RLGATEWAY_REQUIRE_CHROMIUM"):  # CI installs it: missing is a failure
            pytest.fail(message)
        pytest.skip(message)
    from playwright.sync_api import expect, sync_playwright

    with run_gateway(tiny_model, tmp_path) as gw:
        run_id, first, second = record(gw)
        detail = gw.session(first["id"])
        [segment] = detail["segments"]
        with sync_playwright() as p:
            browser = p.chromium.launch(
                executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True
            )
            try:
                page = browser.new_page()
                page.set_default_timeout(20_000)
                page.goto(f"{gw.url}/ui")
                # the page asks for the token, refuses a wrong one, keeps the right one
                page.get_by_test_id("token").fill("wrong")
                page.get_by_test_id("token-submit").click()
                expect(page.get_by_test_id("login-error")).to_contain_text("refused")
                page.get_by_test_id("token").fill(gw.admin_token)
                page.get_by_test_id("token-submit").click()
                token = page.evaluate("sessionStorage.getItem('rlgateway.adminToken')")
                assert token == gw.admin_token

                # the runs list holds the run this test created, beside the engine's state
                expect(page.get_by_test_id("engine-version")).to_have_text("0")
                row = page.locator(f'[data-testid="run-row"][data-run="{run_id}"]')
                expect(row).to_contain_text("ui-e2e")
                row.click()
                expect(page.get_by_test_id("run-id")).to_have_text(run_id)
                # every session's outcome, counted
                expect(page.get_by_test_id("outcome-filtered")).to_have_text("1")
                expect(page.get_by_test_id("outcome-failed")).to_have_text("1")
                expect(page.get_by_test_id("outcome-pending")).to_have_text("0")
                expect(page.get_by_test_id("outcome-trained")).to_have_text("0")
                # its charts read the recorded steps
                expect(page.get_by_test_id("chart-reward_mean")).to_contain_text("last 0.3")
                expect(page.get_by_test_id("chart-tokens_per_s")).to_contain_text("last 300")
                expect(page.get_by_test_id("chart-loss").locator("polyline")).to_have_count(1)
                rows = page.get_by_test_id("session-row")
                expect(rows).to_have_count(2)
                # the export button downloads the run's JSONL
                with page.expect_download() as download:
                    page.get_by_test_id("export").click()
                lines = Path(download.value.path()).read_text().splitlines()
                exported = sorted(json.loads(x)["session_id"] for x in lines)
                assert exported == sorted([first["id"], second["id"]])

                # open the trajectory with the tool result
                page.locator(f'[data-testid="session-row"][data-session="{first["id"]}"]').click()
                expect(page.get_by_test_id("outcome")).to_have_text("failed")
                expect(page.get_by_test_id("failure")).to_have_text("grader raised")
                seg = page.get_by_test_id("segment")
                expect(seg).to_have_count(1)
                sampled = seg.locator(".tok.sampled")
                expect(sampled).to_have_count(sum(segment["loss_mask"]))
                masked = seg.locator(".tok.masked")
                tool = seg.locator(".tok.tool")
                assert masked.count() + tool.count() == len(segment["tokens"]) - sampled.count()
                assert tool.count() > 0  # the tool's output is told apart from other context
                assert "five" in "".join(tool.all_text_contents())
                assert "2+3?" in "".join(masked.all_text_contents())
                badges = seg.get_by_test_id("version-badge")
                expect(badges).to_have_count(1)
                expect(badges).to_have_text("v0")
                style = sampled.first.get_attribute("style") or ""
                assert "background" in style  # coloured by its logprob
                assert "logprob" in (sampled.first.get_attribute("title") or "")

                # back to the run: pause it
                page.get_by_role("link", name=f"← run {run_id}").click()
                page.get_by_test_id("pause").click()
                expect(page.locator("h1").get_by_test_id("status")).to_have_text("paused")
                assert gw.client.get(f"/runs/{run_id}").json()["status"] == "paused"

                # set a reward on the other session by hand; its side request is shown apart
                page.locator(f'[data-testid="session-row"][data-session="{second["id"]}"]').click()
                apart = page.get_by_test_id("side-segment")
                expect(apart).to_have_count(1)
                expect(apart).to_contain_text("side: title")
                [side_seg] = gw.session(second["id"])["segments"][1:]
                struck = apart.locator(".tok.side")
                expect(struck).to_have_count(sum(side_seg["loss_mask"]))
                page.get_by_test_id("reward-value").fill("0.75")
                page.get_by_test_id("reward-submit").click()
                expect(page.get_by_test_id("reward-row")).to_have_count(1)
                expect(page.get_by_test_id("reward-row")).to_contain_text("0.75")

                # a link with the token in its fragment (what `serve` prints) opens the page
                # signed in, in a fresh tab, and the token leaves the address at once
                fresh = browser.new_context().new_page()
                fresh.set_default_timeout(20_000)
                fresh.goto(f"{gw.url}/ui#token={gw.admin_token}")
                expect(
                    fresh.locator(f'[data-testid="run-row"][data-run="{run_id}"]')
                ).to_be_visible()
                assert gw.admin_token not in fresh.url
                kept = fresh.evaluate("sessionStorage.getItem('rlgateway.adminToken')")
                assert kept == gw.admin_token
            finally:
                browser.close()
        rewards = gw.session(second["id"])["rewards"]
        assert [(r["reward"], r["key"]) for r in rewards] == [(0.75, "manual:final")]

        async def status() -> str:
            store = await Store.connect(gw.database_url)
            try:
                return (await store.get_run(run_id)).status
            finally:
                await store.close()

        assert asyncio.run(status()) == "paused"
