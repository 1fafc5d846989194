"""`VLLMEngine`: the Engine protocol over a vLLM OpenAI server, token ids in and out.

Generation, streamed, is one of two routes (`VLLMEngineConfig.api`):
- `POST /inference/v1/generate` (the server runs with `--enable-scale-out`): token ids in, token
  ids and per-token logprobs keyed by id out, nothing detokenized. vLLM spent 2-12% less CPU
  per request on it than on `/v1/completions` with the tiny model, whose tokenizer makes
  detokenizing nearly free (BENCHMARKS.md).
- `POST /v1/completions` with a token-id prompt, `return_token_ids` and `logprobs`: any server.
The server must run with `--logprobs-mode processed_logprobs` (post-temperature logprobs, the
behaviour logprob the trainer recomputes) and `VLLM_SERVER_DEV_MODE=1` (pause, resume, abort and
weight reload); `engines.vllm_launch` starts one that way, and with
`--structured-outputs-config '{"backend": "guidance", "disable_any_whitespace": true}'` so that a
request's JSON schema (`structured_outputs.json`) holds the reply as the local engine's grammar
does (`engines.grammar`).

Weight updates (see `engines.remote` for how in-flight requests survive them):
- from disk: `POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}`,
  then `/reset_prefix_cache` and `/update_weight_version`. The path is read by the server, so give
  it as the server sees it (absolute). A state dict is written to a temporary
  safetensors directory first (the server must share this machine's file system).
- over the weight group (`WeightUpdate.broadcast`, after `join_weight_group`): vLLM's
  four-phase weight-transfer endpoints while the trainer broadcasts (NCCL: GPU servers only).

vLLM 0.32 makes a request that arrives while paused wait; 0.33 answers 503. Both are handled.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from engines.base import Broadcast, FinishReason, SamplingParams, WeightGroup, WeightUpdate
from engines.errors import EngineUnavailableError, WeightUpdateError
from engines.http import EngineHTTP, Reply, raise_for_status
from engines.remote import (
    NO_LABEL,
    Piece,
    RemoteEngine,
    RemoteEngineConfig,
    ServerPaused,
    labelled_version,
)

if TYPE_CHECKING:
    from engines.launch import SupervisedServer

_FINISH = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "abort": FinishReason.ABORT,
}
_METRIC = re.compile(r"^(vllm:num_requests_(?:running|waiting))(?:\{[^}]*\})?\s+([0-9.eE+-]+)$")


@dataclass(frozen=True, slots=True, kw_only=True)
class VLLMEngineConfig(RemoteEngineConfig):
    model: str | None = None
    """The served model name; None takes the first model the server lists."""
    stream_interval: int = 16
    """vLLM streams the first token at once, then every this many tokens (and the last ones):
    one server-sent event per token costs both processes more than the tokens themselves."""
    api: Literal["auto", "generate", "completions"] = "auto"
    """The generation route (module doc): "auto" takes `/inference/v1/generate` where the
    server offers it, else `/v1/completions`."""


GENERATE = "/inference/v1/generate"


class VLLMEngine(RemoteEngine):
    """Build with `await VLLMEngine.connect(config)`."""

    def __init__(
        self,
        config: VLLMEngineConfig,
        model: str,
        max_model_len: int,
        version: int,
        *,
        api: Literal["generate", "completions"] = "completions",
        http: EngineHTTP | None = None,
    ) -> None:
        super().__init__(
            config.url,
            max_model_len=max_model_len,
            version=version,
            base_version=config.version,
            vocab_size=config.vocab_size,
            timeout=config.timeout,
            http=http,
        )
        self.config = config
        self.model = model
        self.api = api
        """The generation route in use (`VLLMEngineConfig.api`, resolved)."""
        self._route = _ROUTES[api]
        self.server: SupervisedServer | None = None
        """A server this engine launched (`engines.vllm_launch`); `close` stops it."""

    @classmethod
    async def connect(cls, config: VLLMEngineConfig) -> VLLMEngine:
        """Ask the server for its model, context length, weight version (an integer label set
        by an earlier update is adopted; otherwise the server is at `config.version`) and, with
        `api="auto"`, whether it offers `/inference/v1/generate`."""
        http = EngineHTTP(config.url, timeout=config.timeout)
        try:
            models = await http.get("/v1/models", within=30)
            raise_for_status(models, "GET /v1/models")
            info = await http.get("/weight_info", within=30)
            api: Literal["generate", "completions"]
            if config.api == "auto":
                # The route validates a body when it is served: 400/422 for an empty one. A
                # server without --enable-scale-out answers 403, an older vLLM 404.
                probe = await http.post(GENERATE, json={}, within=30)
                api = "generate" if probe.status in (400, 422) else "completions"
            else:
                api = config.api
        except BaseException:
            await http.close()
            raise
        cards = models.json()["data"]
        card = next((c for c in cards if c["id"] == config.model), None) if config.model else None
        if card is None:
            if config.model is not None:
                await http.close()
                names = [c["id"] for c in cards]
                raise EngineUnavailableError(
                    f"{http.base_url} serves {names}, not {config.model!r}"
                )
            card = cards[0]
        version = config.version
        if info.status == 200:
            version = labelled_version(info.json().get("weight_version"), config.version)
        return cls(config, card["id"], int(card["max_model_len"]), version, api=api, http=http)

    async def close(self) -> None:
        await super().close()
        if self.server is not None:
            await self.server.stop()

    # -- generation ---------------------------------------------------------------------------

    def _body(
        self, sub_id: str, prompt: tuple[int, ...], sampling: SamplingParams
    ) -> dict[str, Any]:
        """The request body on this engine's route. Both routes take the same sampling fields;
        the generate route nests them."""
        params: dict[str, Any] = {
            "max_tokens": sampling.max_new_tokens,
            "min_tokens": sampling.min_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            "ignore_eos": sampling.ignore_eos,
            "stop_token_ids": list(sampling.stop_token_ids),
            "logprobs": sampling.top_logprobs,
            "skip_special_tokens": False,
            "stream_interval": self.config.stream_interval,
        }
        if sampling.seed is not None:
            params["seed"] = sampling.seed
        if sampling.grammar is not None:  # the guidance backend reads it as llguidance's Lark
            params["structured_outputs"] = {"grammar": sampling.grammar}
        if sampling.json_schema is not None:
            # the server's --structured-outputs-config says the library and the whitespace
            params["structured_outputs"] = {"json": json.loads(sampling.json_schema)}
        return self._route.body(params, sub_id, self.model, list(prompt))

    async def _submit(
        self, sub_id: str, prompt: tuple[int, ...], sampling: SamplingParams
    ) -> AsyncIterator[Piece]:
        route, k = self._route, sampling.top_logprobs
        async with self.http.stream(route.path, self._body(sub_id, prompt, sampling)) as response:
            if response.status == 503:
                raise ServerPaused((await response.read()).text)
            if response.status >= 400:
                raise_for_status(await response.read(), f"POST {route.path}")
            async for data in response.events():
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:  # an error after the stream started
                    raise EngineUnavailableError(f"vLLM stream error: {event['error']}")
                for choice in event.get("choices", ()):
                    yield route.piece(choice, k)

    async def _abort_sub(self, sub_id: str) -> None:
        ids = [self._route.engine_id.format(sub_id)]
        await self.http.post(self._route.abort_path, json={"request_ids": ids})

    # -- control ------------------------------------------------------------------------------

    async def _post(self, path: str, what: str, **kwargs: Any) -> Reply:
        response = await self.http.post(path, **kwargs)
        if response.status == 404:
            raise EngineUnavailableError(
                f"{what}: {self.url}{path} is missing: start vLLM with VLLM_SERVER_DEV_MODE=1"
            )
        raise_for_status(response, what)
        return response

    async def _pause_server(self) -> None:
        await self._post("/pause", "pause", params={"mode": "abort"})

    async def _resume_server(self) -> None:
        await self._post("/resume", "resume")

    async def _load_weights(self, update: WeightUpdate, version: int) -> None:
        if update.path is not None:
            await self._reload(update.path)
        else:
            from engines.weights import save_model_dir

            assert update.state_dict is not None
            root = Path(tempfile.mkdtemp(prefix="rlgateway-weights-"))
            try:
                await asyncio.to_thread(save_model_dir, update.state_dict, root / "model")
                await self._reload(root / "model")
            finally:
                shutil.rmtree(root, ignore_errors=True)
        await self._finish_update(version)

    async def _reload(self, path: Path) -> None:
        body = {"method": "reload_weights", "kwargs": {"weights_path": str(path)}}
        try:
            await self._post("/collective_rpc", f"reload weights from {path}", json=body)
        except EngineUnavailableError as exc:
            raise WeightUpdateError(str(exc)) from exc

    async def _finish_update(self, version: int) -> None:
        """Drop cached prefixes (computed under the old weights) and label the new version."""
        for _ in range(100):  # it answers false while blocks are still held: retry
            r = await self._post("/reset_prefix_cache", "reset the prefix cache")
            if r.json().get("success", True):
                break
            await asyncio.sleep(0.05)
        else:
            raise WeightUpdateError("vLLM kept refusing to reset its prefix cache")
        await self._post(
            "/update_weight_version", "label the weights", json={"new_version": str(version)}
        )

    async def _weight_label(self) -> object:
        info = await self.http.get("/weight_info", within=10)
        return info.json().get("weight_version") if info.status == 200 else NO_LABEL

    async def _probe(self) -> tuple[bool, int, int, str]:
        health = await self.http.get("/health", within=10)
        if health.status != 200:
            return False, 0, 0, f"/health answered {health.status}"
        metrics = await self.http.get("/metrics", within=10)
        load = parse_load(metrics.text) if metrics.status == 200 else {}
        running = int(load.get("vllm:num_requests_running", 0))
        waiting = int(load.get("vllm:num_requests_waiting", 0))
        return True, running, waiting, ""

    # -- the weight group: vLLM's four-phase weight transfer ------------------------------------

    async def weight_group_ranks(self) -> int:
        r = await self.http.get("/get_world_size", params={"include_dp": "true"}, within=30)
        return int(r.json().get("world_size", 1)) if r.status == 200 else 1

    async def _join_group(self, group: WeightGroup, rank_offset: int) -> None:
        """`/init_weight_transfer_engine` (the server runs with `--weight-transfer-config
        '{"backend":"nccl"}'`); it answers once the trainer has joined too."""
        info = {
            "master_address": group.master_address,
            "master_port": group.master_port,
            "rank_offset": rank_offset,
            "world_size": group.world_size,
        }
        await self._post(
            "/init_weight_transfer_engine",
            "join the weight group",
            json={"init_info": info},
            within=group.timeout_s,
        )

    async def _receive(self, broadcast: Broadcast, group: WeightGroup, version: int) -> None:
        """`/start_weight_update`, one `/update_weights` per bucket while the trainer sends its
        tensors, `/finish_weight_update` (which labels the version). vLLM loads each bucket as it
        arrives: after a failure the weights are mixed (the router re-syncs the server), and the
        update is closed unlabelled, since vLLM refuses to start another while one is open."""
        try:
            await self._post("/start_weight_update", "start the weight update", json={})
        except EngineUnavailableError as exc:
            raise WeightUpdateError(str(exc)) from exc
        try:
            for bucket in broadcast.buckets:
                meta = {
                    "names": [t.name for t in bucket],
                    "dtype_names": [t.dtype for t in bucket],
                    "shapes": [list(t.shape) for t in bucket],
                }
                await self._post(
                    "/update_weights",
                    "receive weights",
                    json={"update_info": meta},
                    within=group.timeout_s,
                )
            await self._post(
                "/finish_weight_update",
                "finish the weight update",
                json={"weight_version": str(version)},
            )
        except BaseException as exc:
            with contextlib.suppress(EngineUnavailableError, WeightUpdateError):
                async with asyncio.timeout(10):
                    await self._post("/finish_weight_update", "close the update", json={})
            if isinstance(exc, EngineUnavailableError):
                raise WeightUpdateError(str(exc)) from exc
            raise
        await self._finish_update(version)


def _completion_piece(choice: dict[str, Any], k: int) -> Piece:
    """A `/v1/completions` choice: ids in `token_ids`, logprobs in OpenAI's legacy shape with
    top entries keyed "token_id:N"."""
    ids = tuple(choice.get("token_ids") or ())
    lp = choice.get("logprobs") or {}
    logprobs = tuple(float(x) for x in lp.get("token_logprobs") or ())
    assert len(logprobs) == len(ids), "vLLM sent token ids and logprobs of different lengths"
    tops: tuple[tuple[tuple[int, float], ...], ...] = ()
    if k and ids:
        tops = tuple(
            _top(((int(key.removeprefix("token_id:")), float(v)) for key, v in entry.items()), k)
            for entry in lp.get("top_logprobs") or ()
        )
    return Piece(ids, logprobs, tops, _finish(choice))


def _generate_piece(choice: dict[str, Any], k: int) -> Piece:
    """A `/inference/v1/generate` choice: one `logprobs.content` entry per token, each with its
    id, logprob and candidates (the sampled token first, then the k most likely)."""
    ids = tuple(choice.get("token_ids") or ())
    content = (choice.get("logprobs") or {}).get("content") or ()
    logprobs = tuple(float(e["logprob"]) for e in content)
    assert len(logprobs) == len(ids), "vLLM sent token ids and logprobs of different lengths"
    tops: tuple[tuple[tuple[int, float], ...], ...] = ()
    if k and ids:
        tops = tuple(
            _top(((int(c["token_id"]), float(c["logprob"])) for c in e["top_logprobs"]), k)
            for e in content
        )
    return Piece(ids, logprobs, tops, _finish(choice))


def _finish(choice: dict[str, Any]) -> FinishReason | None:
    reason = choice.get("finish_reason")
    return _FINISH.get(reason, FinishReason.STOP) if reason else None


def _top(pairs: Iterable[tuple[int, float]], k: int) -> tuple[tuple[int, float], ...]:
    """The k most likely of vLLM's candidates, which also list the sampled token (once)."""
    return tuple(sorted(dict(pairs).items(), key=lambda p: -p[1])[:k])


def _generate_body(
    params: dict[str, Any], sub_id: str, model: str, prompt: list[int]
) -> dict[str, Any]:
    return {
        "request_id": sub_id,
        "model": model,
        "token_ids": prompt,
        "sampling_params": params | {"detokenize": False},
        "output_mode": "tokens",
        "stream": True,
    }


def _completion_body(
    params: dict[str, Any], sub_id: str, model: str, prompt: list[int]
) -> dict[str, Any]:
    return params | {
        "model": model,
        "prompt": prompt,
        "request_id": sub_id,
        "stream": True,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }


@dataclass(frozen=True, slots=True)
class _Route:
    """How one generation route is asked, read and aborted."""

    path: str
    body: Callable[[dict[str, Any], str, str, list[int]], dict[str, Any]]
    piece: Callable[[dict[str, Any], int], Piece]
    abort_path: str
    engine_id: str
    """vLLM's engine request id for our request id `{}` (what its abort endpoint takes)."""


_ROUTES = {
    "generate": _Route(
        GENERATE, _generate_body, _generate_piece, "/inference/v1/abort_requests",
        "generate-tokens-{}",
    ),
    "completions": _Route(
        "/v1/completions", _completion_body, _completion_piece, "/abort_requests", "cmpl-{}-0"
    ),
}  # fmt: skip


def parse_load(metrics: str) -> dict[str, float]:
    """Sum of `vllm:num_requests_running` / `_waiting` over label sets, from Prometheus text."""
    out: dict[str, float] = {}
    for line in metrics.splitlines():
        if m := _METRIC.match(line):
            out[m[1]] = out.get(m[1], 0.0) + float(m[2])
    return out
