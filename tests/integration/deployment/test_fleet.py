"""A fleet: two `rlgateway serve` replicas on one PostgreSQL database behind HAProxy, with no
session affinity, as a user deploys more gateways than one machine holds.

- An agent (the openai SDK) whose turns HAProxy sends to alternate replicas gets one exact
  segment, no prefix break.
- Staleness admission holds across replicas: concurrent session creates through the balancer
  admit exactly the bound.
- A trainer publishes once, to whichever replica the balancer picks; the other one loads the
  version too. A replica killed with SIGKILL while a newer version is published serves that
  version from the moment it reports healthy (before it admits anything).
- SQLite takes one gateway: a second `serve` on the same file is refused with a message that
  says to use PostgreSQL, and a gateway killed with SIGKILL leaves no claim behind.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.fleet import POLL, Fleet, run_fleet, wait_for
from tests.support.gateway_server import REPO_ROOT, free_port, run_gateway
from tests.support.load_balancer import REPLICA_HEADER
from tests.support.procs import live_children

# one fleet (two gateways, HAProxy, agents) at a time: both modules on one worker
pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.xdist_group("fleet")]


@pytest.fixture(scope="module")
def fleet(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with run_fleet(tiny_model, tmp_path_factory) as fleet:
        yield fleet


def _run(fleet: Fleet, config: dict[str, object] | None = None) -> str:
    r = fleet.lb.post("/runs", json={"name": "fleet", "config": config or {}})
    assert r.status_code == 201, r.text
    run_id: str = r.json()["id"]
    return run_id


def test_turns_that_alternate_replicas_are_one_segment(fleet: Fleet) -> None:
    run_id = _run(fleet)
    r = fleet.lb.post(f"/runs/{run_id}/sessions", json={"count": 1})
    assert r.status_code == 201, r.text
    s = r.json()["sessions"][0]
    assert s["base_url"].startswith(fleet.url)  # agents talk to the balancer
    agent = openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"])
    messages: list[dict[str, str]] = []
    served_by = []
    for turn in range(6):
        messages.append({"role": "user", "content": f"turn {turn}: go on"})
        raw = agent.chat.completions.with_raw_response.create(
            model="tiny",
            messages=messages,  # type: ignore[arg-type]
            max_tokens=6,
            seed=turn,
        )
        served_by.append(raw.headers[REPLICA_HEADER])
        messages.append(
            {"role": "assistant", "content": raw.parse().choices[0].message.content or ""}
        )
    assert set(served_by) == {"a", "b"}, served_by
    assert all(x != y for x, y in itertools.pairwise(served_by)), served_by
    detail = fleet.lb.get(f"/sessions/{s['id']}").json()
    assert (len(detail["segments"]), detail["prefix_breaks"]) == (1, 0), detail
    assert len(detail["segments"][0]["completion_ids"]) == 6


def test_staleness_admission_holds_across_replicas(fleet: Fleet) -> None:
    run_id = _run(fleet, {"eta": 0, "batch_size": 4})

    def create(_: int) -> tuple[int, str]:
        with httpx.Client(base_url=fleet.url, headers=fleet.lb.headers) as c:
            r = c.post(f"/runs/{run_id}/sessions", json={"count": 1})
            return r.status_code, r.headers.get(REPLICA_HEADER, "")

    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(create, range(12)))
    assert {replica for _, replica in answers} == {"a", "b"}
    assert sorted(code for code, _ in answers) == [201] * 4 + [429] * 8, answers


def test_a_publish_reaches_every_replica_and_a_restarted_one_serves_it_at_once(
    fleet: Fleet, tiny_model: Path
) -> None:
    """Last in the module: it replaces replica b."""
    v = fleet.version("a")
    r = fleet.lb.post("/admin/weights", json={"path": str(tiny_model), "version": v + 1})
    assert r.status_code == 200, r.text
    wait_for(lambda: fleet.version("a") == fleet.version("b") == v + 1, "both serve v + 1")

    fleet.kill("b")
    r = fleet.lb.post("/admin/weights", json={"path": str(tiny_model), "version": v + 2})
    assert r.status_code == 200, r.text
    assert fleet.replica_of(r) == "a"
    # no polling: what it serves when it reports healthy, it loaded at start
    restarted = fleet.restart("b", RLGATEWAY_POLICY_POLL_SECONDS="0")
    assert restarted.client.get("/admin/version").json()["version"] == v + 2
    # and it follows no publish: policy_poll_seconds 0 is one gateway's setting
    r = fleet.replicas["a"].client.post(
        "/admin/weights", json={"path": str(tiny_model), "version": v + 3}
    )
    assert r.status_code == 200, r.text
    time.sleep(10 * float(POLL))
    assert restarted.client.get("/admin/version").json()["version"] == v + 2
    wait_for(
        lambda: "b" in {fleet.replica_of(fleet.lb.get("/health")) for _ in range(4)},
        "the balancer sends to b again",
    )


def test_a_second_gateway_on_one_sqlite_file_is_refused(tiny_model: Path, tmp_path: Path) -> None:
    with run_gateway(tiny_model, tmp_path) as first:
        second = subprocess.run(
            [
                *(sys.executable, "-m", "rlgateway.cli", "serve", "--port", str(free_port())),
                *("--database-url", first.database_url, "--model", str(tiny_model)),
            ],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode != 0
        assert "SQLite takes one gateway" in second.stderr, second.stderr
        assert "postgresql://" in second.stderr
        os.killpg(first.pid, signal.SIGKILL)
        wait_for(lambda: all(p != first.pid for p, _ in live_children(os.getpid())), "gone")
    with run_gateway(tiny_model, tmp_path) as again:  # the dead gateway's claim went with it
        assert again.client.get("/health").status_code == 200
