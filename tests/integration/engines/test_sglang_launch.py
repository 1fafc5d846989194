"""`rlgateway serve --engine sglang --engine-launch`: the gateway starts and supervises SGLang from
an interpreter of its own, as it does vLLM. A stand-in package (`tests/support/fake_sglang_pkg`)
plays `python -m sglang.launch_server` with the fake SGLang server, so no SGLang is needed; the
real server runs in `.ci/gpu-check.sh` where a GPU is."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import httpx
import pytest

from engines.sglang_launch import ORIGINAL_LOGPROB_ENV, SGLangLaunchConfig, SGLangServer
from tests.support.gateway_server import REPO_ROOT, run_gateway
from tests.support.paths import SUPPORT

pytestmark = pytest.mark.slow

FAKE = SUPPORT / "fake_sglang_pkg"
PYTHONPATH = os.pathsep.join([str(FAKE), str(REPO_ROOT)])


async def test_the_launcher_starts_sglang_with_its_flags_restarts_it_and_stops_it(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = tmp_path / "starts.jsonl"
    # logprobs before the temperature would not be what the trainer recomputes: cleared
    monkeypatch.setenv(ORIGINAL_LOGPROB_ENV, "1")
    cfg = SGLangLaunchConfig(
        model=str(tiny_model),
        python=sys.executable,
        served_model_name="tiny",
        max_model_len=512,
        extra_args=("--tp-size", "1"),
        env={"PYTHONPATH": PYTHONPATH, "FAKE_SGLANG_RECORD": str(record)},
        log_file=str(tmp_path / "sglang.log"),
    )
    server = SGLangServer(cfg, max_restarts=1)
    await server.start(startup_s=120)
    try:
        async with httpx.AsyncClient() as http:
            info = (await http.get(f"{server.url}/model_info")).json()
        assert info["model_path"] == str(tiny_model)
        [first] = [json.loads(line) for line in record.read_text().splitlines()]
        argv = first["argv"]
        assert argv[argv.index("--model-path") + 1] == str(tiny_model)
        assert argv[argv.index("--served-model-name") + 1] == "tiny"
        assert argv[argv.index("--context-length") + 1] == "512"
        assert argv[argv.index("--grammar-backend") + 1] == "llguidance"
        assert argv[argv.index("--port") + 1] == str(server.port)
        assert argv[-2:] == ["--tp-size", "1"]
        assert first["env"] == {ORIGINAL_LOGPROB_ENV: None, "HF_HUB_OFFLINE": "1"}

        pid = server.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)  # the server crashes: the supervisor starts it again
        # restarted: a new process that has come up far enough to record its start (a loaded
        # machine can take seconds between the two)
        for _ in range(1200):
            started = len(record.read_text().splitlines())
            if server.restarts == 1 and server.pid != pid and server.running and started == 2:
                break
            await asyncio.sleep(0.1)
        assert server.restarts == 1
        assert len(record.read_text().splitlines()) == 2
    finally:
        await server.stop()
    assert not server.running
    async with httpx.AsyncClient() as http:
        with pytest.raises(httpx.TransportError):
            await http.get(f"{server.url}/health", timeout=2)


def test_serve_launches_sglang_and_records_through_it(tiny_model: Path, tmp_path: Path) -> None:
    args = ["--engine", "sglang", "--engine-launch", "--sglang-python", sys.executable]
    record = tmp_path / "starts.jsonl"
    env = {"PYTHONPATH": PYTHONPATH, "FAKE_SGLANG_RECORD": str(record)}
    with run_gateway(tiny_model, tmp_path, extra_args=args, extra_env=env, timeout=240) as gw:
        s = gw.new_session()
        r = httpx.post(
            f"{s['base_url']}/chat/completions",
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 5,
            },
            headers={"Authorization": f"Bearer {s['api_key']}"},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
        detail = gw.session(s["id"])
        assert (
            sum(sum(seg["loss_mask"]) for seg in detail["segments"])
            == r.json()["usage"]["completion_tokens"]
        )
        health = gw.client.get("/health").json()
        assert health["ok"] is True, health
    # the gateway stopped the server it started when it shut down
    [start] = [json.loads(line) for line in record.read_text().splitlines()]
    port = start["argv"][start["argv"].index("--port") + 1]
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)


def test_serve_train_publishes_into_sglang_in_process(tiny_model: Path, tmp_path: Path) -> None:
    """`serve --train --engine sglang`: every step's weights (an in-process state dict) reach the
    SGLang server, which serves each new version; this used to fail at the first publish."""
    from tests.support.deployment import STEPS, drive, run_config

    config = run_config(tmp_path)
    args = ["--train", "--config", str(config), "--engine", "sglang", "--engine-launch"]
    args += ["--sglang-python", sys.executable]
    record = tmp_path / "starts.jsonl"
    env = {"PYTHONPATH": PYTHONPATH, "FAKE_SGLANG_RECORD": str(record)}
    with run_gateway(tiny_model, tmp_path, extra_args=args, extra_env=env, timeout=240) as gw:
        drive(gw, gw.trained_run(), STEPS)
        assert gw.client.get("/admin/version").json() == {"version": STEPS}
        [start] = [json.loads(line) for line in record.read_text().splitlines()]
        port = start["argv"][start["argv"].index("--port") + 1]
        info = httpx.get(f"http://127.0.0.1:{port}/model_info", timeout=10).json()
        assert info["weight_version"] == str(STEPS)  # the server itself serves the new policy
