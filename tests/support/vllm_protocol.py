"""An in-process stand-in for vLLM's HTTP protocol (pause semantics, scale-out, weight
versions), for the unit tests of the vLLM engine client and the policy version."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from engines.vllm import GENERATE


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
