"""Property-based: whatever an agent or an operator sends, the gateway answers it alone.

Schemathesis generates requests for every operation of the gateway's own OpenAPI document
(schema-conforming and not), against a real `rlgateway serve` on loopback. Path ids are real ones
half of the time (a run, a session and its key, made before the run), so the handlers behind the
404 are reached too. For every case: no 5xx, and every error is an OpenAI-shaped JSON body.
After all cases: the engine still serves a good request, and the store holds nothing
half-written (every recorded segment's four arrays share one length).

`RLGATEWAY_FUZZ_EXAMPLES` sets the examples per operation (default 80: about 2,000 cases).
"""

from __future__ import annotations

import itertools
import json
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.generation import GenerationMode

from tests.support.gateway_server import GatewayHandle, run_gateway

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("RLGATEWAY_FUZZ_EXAMPLES", "80"))
DESTRUCTIVE = {("DELETE", "/runs/{run_id}"), ("POST", "/runs/{run_id}/stop")}
"""Operations that would end the fuzzing run for the others: they get only generated ids."""
SEEN: dict[str, int] = {"cases": 0}


@pytest.fixture(scope="module")
def fuzz_gw(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayHandle]:
    # A short context keeps every generated completion short: the cases test the edge, not decode.
    env = {"RLGATEWAY_MAX_MODEL_LEN": "96"}
    with run_gateway(tiny_model, tmp_path_factory.mktemp("gw-fuzz"), extra_env=env) as gw:
        yield gw


@pytest.fixture(scope="module")
def known(fuzz_gw: GatewayHandle) -> dict[str, str]:
    """Real ids for the generated paths: a run, and one of its sessions with its key."""
    run_id = fuzz_gw.create_run("fuzz")  # no staleness bound: its sessions are all admitted
    [session] = fuzz_gw.new_sessions(1, run_id=run_id)
    return {"run_id": run_id, "session_id": session["id"], "session_key": session["api_key"]}


def operations() -> list[tuple[str, str, str]]:
    """(method, path, mode) of every operation in the gateway's OpenAPI document, read
    in-process: schema-conforming cases for each, and non-conforming ones for each operation
    that takes any input (one without parameters or body has no invalid request to make)."""
    from gateway.settings import GatewaySettings
    from rlgateway.app import create_app

    doc = create_app(GatewaySettings(admin_token="x")).openapi()
    out = []
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            out.append((method.upper(), path, "positive"))
            if op.get("parameters") or op.get("requestBody"):
                out.append((method.upper(), path, "negative"))
    return out


@pytest.mark.parametrize(("method", "path", "mode"), operations())
def test_no_request_breaks_the_gateway(
    fuzz_gw: GatewayHandle, known: dict[str, str], method: str, path: str, mode: str
) -> None:
    """Schemathesis' pytest plugin reaches into a pytest internal that pytest 9.2 removed, so its
    strategies are driven with hypothesis directly, one operation per test."""
    api = schemathesis.openapi.from_url(f"{fuzz_gw.url}/openapi.json")
    operation = api[path][method]
    strategy = operation.as_strategy(generation_mode=GenerationMode(mode))
    real_ids = (method, path) not in DESTRUCTIVE
    turn = itertools.count()

    @settings(
        max_examples=EXAMPLES if mode == "positive" else max(1, EXAMPLES // 2),
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def check(case: Any) -> None:
        n = next(turn)
        key = fuzz_gw.admin_token
        if real_ids and n % 2 == 0:
            for name in ("run_id", "session_id"):
                if name in (case.path_parameters or {}):
                    case.path_parameters[name] = known[name]
        if path.startswith("/sessions/{session_id}/v1") and n % 4 < 2:
            key = known["session_key"]
        response = case.call(
            base_url=fuzz_gw.url, headers={"Authorization": f"Bearer {key}"}, timeout=60
        )
        SEEN["cases"] += 1
        where = (
            f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text[:300]}"
        )
        assert response.status_code < 500, where
        if response.status_code >= 400:
            body = response.json()
            error = body.get("error") if isinstance(body, dict) else None
            assert isinstance(error, dict), where
            assert isinstance(error.get("message"), str), where
            assert error["message"], where
            assert isinstance(error.get("type"), str), where

    try:
        check()
    except Unsatisfiable:
        # Every input of this operation conforms to its schema (a free-form path id, say): there
        # is no non-conforming request to make. Only the negative mode can get here.
        assert mode == "negative"


def test_after_the_fuzz_the_engine_serves_and_nothing_is_half_written(
    fuzz_gw: GatewayHandle, known: dict[str, str]
) -> None:
    health = httpx.get(f"{fuzz_gw.url}/health", timeout=10)
    assert health.status_code == 200, health.text
    [session] = fuzz_gw.new_sessions(1, run_id=fuzz_gw.create_run("after the fuzz"))
    r = httpx.post(
        f"{session['base_url']}/chat/completions",
        headers={"Authorization": f"Bearer {session['api_key']}"},
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    runs = fuzz_gw.client.get("/runs").json()["runs"]
    checked = 0
    for run in runs:
        listed = fuzz_gw.client.get(f"/runs/{run['id']}/sessions", params={"limit": 200}).json()
        for s in listed["sessions"]:
            for seg in fuzz_gw.session(s["id"])["segments"]:
                n = len(seg["tokens"])
                assert len(seg["loss_mask"]) == len(seg["logprobs"]) == len(seg["versions"]) == n
                checked += 1
    assert checked >= 1
    db_path = fuzz_gw.database_url.removeprefix("sqlite:///")
    with sqlite3.connect(db_path) as db:
        torn = db.execute(
            # a replaced turn (a retry took its place) is kept but is no longer in its segment
            "SELECT s.id FROM segments s JOIN completions c "
            "ON c.segment_id = s.id AND c.status != 'replaced' GROUP BY s.id "
            "HAVING s.length != SUM(length(c.prompt_delta) + length(c.output_ids)) / 4 "
            "OR SUM(length(c.output_ids)) != SUM(length(c.logprobs)) "
            "OR SUM(length(c.output_ids)) != SUM(length(c.versions))"
        ).fetchall()
    assert torn == []
    print(json.dumps({"fuzz_cases": SEEN["cases"]}))
