"""A stand-in SGLang server for tests: SGLang 0.5.x's native HTTP surface with real generation.

SGLang has no CPU build on PyPI, so the adapter is tested against this server, which reproduces
the request and response shapes of `/generate` and the control endpoints as SGLang documents
them (the native API reference: `/generate`, `update_weights_from_disk`, pause and
continue generation, flush cache) and generates with the tiny model
through transformers, so tokens and logprobs are real:

- `/generate`: `input_ids`, `sampling_params` (max_new_tokens, min_new_tokens, temperature, top_p,
  top_k (-1 off), stop_token_ids, ignore_eos, sampling_seed, no_stop_trim, json_schema and
  ebnf (Lark, as `--grammar-backend llguidance` reads it): the logits masked by the grammar
  before the logprobs, as SGLang does), `return_logprob`,
  `top_logprobs_num`, `rid`, `stream` (cumulative SSE events, then `data: [DONE]`).
  `meta_info.output_token_logprobs` holds `[logprob, id, null]`, post-temperature;
  `finish_reason` is `{"type": "stop"|"length"|"abort", ...}`; aborted requests return their
  partial output with HTTP 200.
- `/pause_generation {"mode"}` (abort finishes running requests; new ones wait for continue),
  `/continue_generation`, `/abort_request {"rid"|"abort_all"}`, `/flush_cache` (400 while requests
  run), `/update_weights_from_disk`, `/init_weights_update_group` and
  `/update_weights_from_distributed` (gloo on CPU instead of NCCL), `/health`, `/model_info`,
  `/server_info`, `/v1/loads`.

Test hooks, not SGLang's (`/fake/...`): `GET /fake/weights_digest` (`weights_digest` of the
served model's state dict) and `POST /fake/fail_next_receive` (the next
`/update_weights_from_distributed` receives its first tensor only, then answers 400
`{"success": false, "message": "injected failure"}` and loads nothing).

The generation core (`FakeSGLang.generate`, `load_state`, `join_group`, `receive_tensors`) is
shared with the fake vLLM server (`tests.support.fake_vllm`).

Run: `python -m tests.support.fake_sglang --model DIR --port PORT`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from transformers import AutoModelForCausalLM, GenerationConfig

from engines.constraint import Grammars


@dataclass(eq=False)
class _Req:
    rid: str
    input_ids: list[int]
    params: dict[str, Any]
    top_n: int
    output: list[int] = field(default_factory=list)
    logprobs: list[list[Any]] = field(default_factory=list)
    tops: list[list[list[Any]]] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    aborted: str | None = None
    weight_version: str = "default"
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def meta(self) -> dict[str, Any]:
        return {
            "id": self.rid,
            "finish_reason": self.finish,
            "prompt_tokens": len(self.input_ids),
            "completion_tokens": len(self.output),
            "cached_tokens": 0,
            "weight_version": self.weight_version,
            "output_token_logprobs": self.logprobs,
            "output_top_logprobs": self.tops,
        }


class FakeSGLang:
    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir
        self.model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.eval()
        gen = GenerationConfig.from_pretrained(model_dir)
        eos = gen.eos_token_id
        self.eos = {eos} if isinstance(eos, int) else set(eos or ())
        self.grammars = Grammars(model_dir, int(self.model.config.vocab_size))
        self.version = "default"
        self.running: dict[str, _Req] = {}
        self.unpaused = asyncio.Event()
        self.unpaused.set()
        self.step_lock = asyncio.Lock()
        self.group: Any = None
        self.fail_next_receive = False
        """Test hook (`POST /fake/fail_next_receive`): the next receive over the group fails."""
        self.receives = 0
        """Test hook (`GET /fake/receives`): receive calls over the group (one per bucket)."""

    async def generate(self, req: _Req) -> None:
        p = req.params
        max_new = int(p.get("max_new_tokens", 128))
        min_new = int(p.get("min_new_tokens", 0))
        temperature = float(p.get("temperature", 1.0))
        top_p = float(p.get("top_p", 1.0))
        top_k = int(p.get("top_k", -1))
        stops = set(p.get("stop_token_ids") or ()) | (set() if p.get("ignore_eos") else self.eos)
        constraint = None
        schema, ebnf = p.get("json_schema"), p.get("ebnf")
        if schema is not None or ebnf is not None:  # SGLang masks the logits before its logprobs
            constraint = self.grammars.matcher(
                None if schema is None else str(schema), None if ebnf is None else str(ebnf)
            )
        rng = torch.Generator()
        if p.get("sampling_seed") is not None:
            rng.manual_seed(int(p["sampling_seed"]))
        else:
            rng.seed()
        await self.unpaused.wait()  # new requests wait while paused
        self.running[req.rid] = req
        req.weight_version = self.version
        past: Any = None
        ids = torch.tensor([req.input_ids])
        try:
            while req.finish is None:
                if req.aborted is not None:
                    req.finish = {"type": "abort", "message": req.aborted, "status_code": None}
                    break
                async with self.step_lock:
                    out = await asyncio.to_thread(self._forward, ids, past)
                past = out.past_key_values
                logits = out.logits[0, -1].float()
                if constraint is not None:
                    logits = logits.masked_fill(~constraint.allowed(frozenset(stops)), -torch.inf)
                logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
                masked = logp.clone()
                if len(req.output) < min_new:
                    masked[list(stops)] = -torch.inf
                tok = self._sample(masked, temperature, top_p, top_k, rng)
                if constraint is not None and tok not in stops:
                    constraint.accept(tok)
                req.output.append(tok)
                req.logprobs.append([float(logp[tok]), tok, None])
                if req.top_n:
                    vals, idx = logp.topk(req.top_n)
                    pairs = zip(vals.tolist(), idx.tolist(), strict=True)
                    req.tops.append([[v, i, None] for v, i in pairs])
                if tok in stops and len(req.output) >= min_new:
                    req.finish = {"type": "stop", "matched": tok}
                elif len(req.output) >= max_new:
                    req.finish = {"type": "length", "length": max_new}
                ids = torch.tensor([[tok]])
                req.changed.set()
                await asyncio.sleep(0)
        finally:
            self.running.pop(req.rid, None)
            req.changed.set()

    def _forward(self, ids: torch.Tensor, past: Any) -> Any:
        with torch.no_grad():
            return self.model(input_ids=ids, past_key_values=past, use_cache=True)

    @staticmethod
    def _sample(
        logp: torch.Tensor, temperature: float, top_p: float, top_k: int, rng: torch.Generator
    ) -> int:
        if temperature == 0:
            return int(logp.argmax())
        probs = logp.exp()
        if top_k > 0:
            kth = probs.topk(top_k).values[-1]
            probs = torch.where(probs >= kth, probs, 0.0)
        if top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            keep = sorted_p.cumsum(0) - sorted_p < top_p
            probs = torch.zeros_like(probs).scatter(0, order, sorted_p * keep)
        return int(torch.multinomial(probs / probs.sum(), 1, generator=rng))

    def load_dir(self, path: str) -> None:
        from safetensors.torch import load_file

        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise ValueError(f"no safetensors files in {path}")
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(str(f)))
        self.load_state(state)

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        own = self.model.state_dict()
        unknown = set(state) - set(own)
        if unknown:
            raise ValueError(f"unknown parameters {sorted(unknown)[:3]}")
        with torch.no_grad():
            for name, t in state.items():
                own[name].copy_(t)

    def digest(self) -> dict[str, str]:
        """Test hook: `weights_digest` of the served weights."""
        return weights_digest(self.model.state_dict())


def weights_digest(state_dict: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """{name: sha256 hex of the tensor's bytes as contiguous CPU float32}: what the fakes'
    `GET /fake/weights_digest` answers for their model, to compare with a trainer's state dict."""
    out = {}
    for name, t in state_dict.items():
        data = t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
        out[name] = hashlib.sha256(data).hexdigest()
    return out


JOIN_TIMEOUT = datetime.timedelta(seconds=60)
"""How long the fakes wait for the trainer to open its weight group's store."""


def group_timeout() -> datetime.timedelta:
    """What bounds each collective of the fakes' weight group: `$FAKE_GROUP_TIMEOUT_S` seconds
    (default 60), so that a test of a broken transfer does not leave a fake waiting long."""
    return datetime.timedelta(seconds=float(os.environ.get("FAKE_GROUP_TIMEOUT_S", "60")))


def join_group(address: str, port: int, rank: int, world_size: int, name: str) -> Any:
    """Join the weight group `name` as `rank` (blocking: run it in a thread), as SGLang's
    `init_custom_process_group` does: a client of the trainer's TCPStore at `address:port`, its
    keys prefixed by the group's name (once by SGLang, once by torch's process-group helper) and
    the device; gloo where the real servers use NCCL."""
    import torch.distributed as dist

    store = dist.TCPStore(  # type: ignore[attr-defined]
        address, port, world_size, is_master=False, timeout=JOIN_TIMEOUT
    )
    prefixed = dist.PrefixStore(  # type: ignore[attr-defined]
        "cpu/",
        dist.PrefixStore(f"{name}/", dist.PrefixStore(name, store)),  # type: ignore[attr-defined]
    )
    return dist.ProcessGroupGloo(prefixed, rank, world_size, group_timeout())


def receive_tensors(
    group: Any,
    names: Sequence[str],
    dtypes: Sequence[str],
    shapes: Sequence[Sequence[int]],
    limit: int | None = None,
) -> dict[str, torch.Tensor]:
    """Receive one broadcast from rank 0 per tensor, in order (blocking: run it in a thread);
    only the first `limit` when given."""
    import torch.distributed as dist

    out = {}
    metas = list(zip(names, dtypes, shapes, strict=True))
    for name, dtype, shape in metas[:limit]:
        t = torch.empty(list(shape), dtype=getattr(torch, dtype))
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        group.broadcast([t], opts).wait()
        out[name] = t
    return out


def build_app(server: FakeSGLang) -> FastAPI:
    app = FastAPI()

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        body = await request.json()
        if "input_ids" not in body:
            return JSONResponse({"error": {"message": "input_ids is required"}}, status_code=400)
        req = _Req(
            rid=body.get("rid") or f"rid-{id(body)}",
            input_ids=[int(t) for t in body["input_ids"]],
            params=body.get("sampling_params") or {},
            top_n=int(body.get("top_logprobs_num") or 0),
        )
        task = asyncio.create_task(server.generate(req))
        if not body.get("stream"):
            await task
            return {"text": "", "output_ids": req.output, "meta_info": req.meta()}

        async def events() -> AsyncIterator[str]:
            try:
                sent = -1
                while True:
                    await req.changed.wait()
                    req.changed.clear()
                    if len(req.output) != sent or req.finish is not None:
                        sent = len(req.output)
                        event = {"text": "", "output_ids": req.output, "meta_info": req.meta()}
                        yield f"data: {json.dumps(event)}\n\n"
                    if req.finish is not None:
                        break
                yield "data: [DONE]\n\n"
            finally:
                if req.finish is None:  # the client went away: SGLang aborts the request
                    req.aborted = "client disconnected"
                await asyncio.gather(task, return_exceptions=True)

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/abort_request")
    async def abort_request(request: Request) -> PlainTextResponse:
        body = await request.json()
        for rid, req in list(server.running.items()):
            if body.get("abort_all") or rid == body.get("rid"):
                req.aborted = "Abort request"
        return PlainTextResponse("")

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> dict[str, str]:
        body = await request.json() if await request.body() else {}
        server.unpaused.clear()
        if body.get("mode", "abort") == "abort":
            for req in list(server.running.values()):
                req.aborted = "Abort by pause_generation"
            while server.running:
                await asyncio.sleep(0.005)
        return {"status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation() -> dict[str, str]:
        server.unpaused.set()
        return {"status": "ok"}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> PlainTextResponse:
        if server.running:
            return PlainTextResponse("Cache not flushed: requests are running", status_code=400)
        return PlainTextResponse("Cache flushed.")

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> JSONResponse:
        body = await request.json()
        while server.running and server.unpaused.is_set():  # the writer lock waits for requests
            await asyncio.sleep(0.01)
        try:
            async with server.step_lock:
                await asyncio.to_thread(server.load_dir, body["model_path"])
        except (ValueError, OSError) as exc:
            return JSONResponse({"success": False, "message": str(exc)}, status_code=400)
        if body.get("weight_version") is not None:
            server.version = str(body["weight_version"])
        message = "Succeeded to update model weights."
        return JSONResponse({"success": True, "message": message, "num_paused_requests": 0})

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request) -> JSONResponse:
        body = await request.json()
        server.group = await asyncio.to_thread(
            join_group,
            body["master_address"],
            int(body["master_port"]),
            int(body["rank_offset"]),
            int(body["world_size"]),
            str(body.get("group_name") or "weight_update_group"),
        )
        return JSONResponse({"success": True, "message": "Succeeded to initialize group."})

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request) -> JSONResponse:
        body = await request.json()
        if server.group is None:
            return JSONResponse({"success": False, "message": "no group"}, status_code=400)
        metas = (server.group, body["names"], body["dtypes"], body["shapes"])
        server.receives += 1
        if server.fail_next_receive:  # test hook: fail part-way, load nothing
            server.fail_next_receive = False
            await asyncio.to_thread(receive_tensors, *metas, limit=1)
            message = "injected failure"
            return JSONResponse({"success": False, "message": message}, status_code=400)
        async with server.step_lock:
            state = await asyncio.to_thread(receive_tensors, *metas)
            server.load_state(state)
        if body.get("weight_version") is not None:
            server.version = str(body["weight_version"])
        return JSONResponse({"success": True, "message": "Succeeded to update weights."})

    @app.get("/health")
    async def health() -> PlainTextResponse:
        return PlainTextResponse("")

    @app.get("/model_info")
    async def model_info() -> dict[str, Any]:
        return {
            "model_path": server.model_dir,
            "is_generation": True,
            "weight_version": server.version,
        }

    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        return {
            "context_length": int(server.model.config.max_position_embeddings),
            "version": "0.5.23-fake",
        }

    @app.get("/v1/loads")
    async def loads() -> dict[str, Any]:
        waiting = 0 if server.unpaused.is_set() else 1
        load = {"dp_rank": 0, "num_running_reqs": len(server.running), "num_waiting_reqs": waiting}
        return {"loads": [load]}

    add_test_hooks(app, server)
    return app


def add_test_hooks(app: FastAPI, server: FakeSGLang) -> None:
    """The fakes' test hooks, under `/fake/` (no real server has them): `GET
    /fake/weights_digest` -> `{"digest": weights_digest(served weights)}`; `POST
    /fake/fail_next_receive` arms `server.fail_next_receive` (the next receive over the weight
    group takes the first tensor only, then fails without loading anything); `GET
    /fake/receives` -> `{"calls": receive calls over the weight group so far}`."""

    @app.get("/fake/weights_digest")
    async def fake_weights_digest() -> dict[str, Any]:
        async with server.step_lock:
            return {"digest": server.digest()}

    @app.post("/fake/fail_next_receive")
    async def fake_fail_next_receive() -> dict[str, bool]:
        server.fail_next_receive = True
        return {"armed": True}

    @app.get("/fake/receives")
    async def fake_receives() -> dict[str, int]:
        return {"calls": server.receives}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    app = build_app(FakeSGLang(args.model))
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


@contextlib.contextmanager
def run_fake_sglang(
    model_dir: str | Path, port: int | None = None, startup_s: float = 120
) -> Iterator[FakeServer]:
    """Start the fake server as a subprocess on loopback (a free port unless given); kill it on
    exit."""
    with run_fake("tests.support.fake_sglang", model_dir, port, startup_s=startup_s) as server:
        yield server


@contextlib.contextmanager
def run_fake(
    module: str,
    model_dir: str | Path,
    port: int | None = None,
    args: Sequence[str] = (),
    *,
    startup_s: float = 120,
) -> Iterator[FakeServer]:
    """`python -m module --model DIR --port PORT [args]` on loopback (a free port unless given),
    once its `/health` answers; killed on exit."""
    if port is None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
    cmd = [sys.executable, "-m", module, "--model", str(model_dir), "--port", str(port), *args]
    proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[2], env=os.environ)
    server = FakeServer(f"http://127.0.0.1:{port}", proc)
    try:
        deadline = time.monotonic() + startup_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{module} exited with {proc.returncode}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{module} did not come up")
            time.sleep(0.2)
        yield server
    finally:
        server.kill()


@dataclass
class FakeServer:
    url: str
    proc: subprocess.Popen[bytes]

    def kill(self) -> None:
        """SIGKILL: the server dies mid-whatever, as a crashed server does."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


if __name__ == "__main__":
    main()
