"""Each program in agents_examples/ runs unmodified (a subprocess, base_url and key only) against a
real `rlgateway serve`, and what it did is checked in the store through `GET /sessions/{id}`."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.gateway_server import REPO_ROOT, GatewayHandle, run_gateway

pytestmark = pytest.mark.slow

EXAMPLES = REPO_ROOT / "agents_examples"


def run_example(name: str, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Runs agents_examples/NAME and returns its last JSON line."""
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    last: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return last


def assert_recorded(detail: dict[str, Any], completions: int) -> None:
    """An ended, rewarded session whose segments hold `completions` completions, with sampled
    tokens carrying logprobs and versions and prompt tokens masked out."""
    assert detail["status"] == "ended"
    assert detail["rewards"], "no reward was posted"
    covered = [cid for seg in detail["segments"] for cid in seg["completion_ids"]]
    assert len(covered) == completions
    for seg in detail["segments"]:
        n = len(seg["tokens"])
        assert n == len(seg["loss_mask"]) == len(seg["logprobs"]) == len(seg["versions"])
        sampled = [i for i, m in enumerate(seg["loss_mask"]) if m]
        assert sampled, "a segment with no sampled token"
        assert all(seg["versions"][i] >= 0 and seg["logprobs"][i] <= 0 for i in sampled)
        assert seg["loss_mask"][0] == 0


def session_args(s: dict[str, Any]) -> list[str]:
    return ["--base-url", s["base_url"], "--api-key", s["api_key"]]


@pytest.fixture(scope="module")
def gw(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayHandle]:
    with run_gateway(tiny_model, tmp_path_factory.mktemp("gw-examples")) as handle:
        yield handle


def test_single_turn_agent(gw: GatewayHandle) -> None:
    s = gw.new_session(group_id="q1", metadata={"task": "What letter comes after k?"})
    out = run_example(
        "single_turn_agent.py", *session_args(s), "--question", "What letter comes after k?"
    )
    detail = gw.session(s["id"])
    assert_recorded(detail, completions=1)
    assert detail["rewards"][0]["reward"] == out["reward"]
    assert detail["segments"][0]["completion_ids"] == [out["completion_id"]]


def test_tool_agent_calls_the_calculator_and_is_recorded_as_one_segment(
    tmp_path: Path,
) -> None:
    from tests.support.scripted_model import scripted_model_dir

    with run_gateway(scripted_model_dir(), tmp_path) as scripted:
        s = scripted.new_session()
        out = run_example("tool_agent.py", *session_args(s), "--question", "What is 2 plus 3?")
        assert out["tool_calls"] == [{"name": "add", "arguments": '{"a": 2, "b": 3}'}]
        assert out["turns"] == 2, out
        assert out["reward"] == 1.0, out
        detail = scripted.session(s["id"])
    assert_recorded(detail, completions=2)
    assert len(detail["segments"]) == 1, "the tool round trip must continue the same segment"
    assert detail["prefix_breaks"] == 0


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_langchain_agent_unmodified(gw: GatewayHandle, api: str) -> None:
    s = gw.new_session()
    out = run_example("langchain_agent.py", *session_args(s), "--api", api)
    assert len(out["answers"]) == 2
    detail = gw.session(s["id"])
    assert_recorded(detail, completions=2)
    ids = [c for seg in detail["segments"] for c in seg["completion_ids"]]
    assert all(
        c.startswith({"chat": "chatcmpl-", "responses": "resp_", "messages": "msg_"}[api])
        for c in ids
    ), ids
    assert detail["rewards"][0]["reward"] == out["reward"]


def test_grpo_harness_runs_groups_and_posts_rewards(gw: GatewayHandle) -> None:
    r = gw.client.post("/runs", json={"name": "harness", "config": {}})
    run_id, run_key = r.json()["id"], r.json()["api_key"]
    out = run_example(
        "grpo_harness.py",
        *("--gateway", gw.url, "--key", run_key, "--run", run_id),
        *("--tasks", "3", "--group-size", "4", "--concurrency", "2"),
    )
    assert out["run"] == run_id
    assert out["groups"] == 3
    db = gw.database_url.removeprefix("sqlite:///")
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT id, group_id FROM sessions WHERE run_id = ?", (run_id,))
        sessions = rows.fetchall()
    assert len(sessions) == 12
    by_group: dict[str, int] = {}
    for sid, group in sessions:
        by_group[group] = by_group.get(group, 0) + 1
        assert_recorded(gw.session(sid), completions=1)
    assert sorted(by_group.values()) == [4, 4, 4]
