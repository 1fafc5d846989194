"""`SGLangEngine`: the Engine protocol over an SGLang server's native API, token ids in and out.

Generation is `POST /generate` with `input_ids`, `return_logprob` and `stream`; tokens and
behaviour logprobs come from `meta_info.output_token_logprobs` (`[logprob, id, text]` triples;
SGLang's default logprob is already post-temperature). Streamed events are cumulative unless the
server runs with `--incremental-streaming-output`; `meta_info.completion_tokens` tells which
entries are new either way.

Control: `/pause_generation {"mode":"abort"}` and `/continue_generation` around a weight update,
`/abort_request {"rid"}`, `/update_weights_from_disk` (an in-process state dict is first written
as a model directory: the server must share this machine's filesystem),
`/init_weights_update_group` + `/update_weights_from_distributed` per bucket (the weight
group: the trainer broadcasts meanwhile), `/flush_cache` (400 while requests run: retried),
`/health`. In-flight requests survive updates as `engines.remote` says.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engines.base import Broadcast, FinishReason, SamplingParams, WeightGroup, WeightUpdate
from engines.errors import EngineUnavailableError, WeightUpdateError
from engines.http import EngineHTTP, Reply, raise_for_status
from engines.launch import SupervisedServer
from engines.remote import (
    NO_LABEL,
    Piece,
    RemoteEngine,
    RemoteEngineConfig,
    labelled_version,
)

if TYPE_CHECKING:
    pass

_FINISH = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "abort": FinishReason.ABORT,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class SGLangEngineConfig(RemoteEngineConfig):
    max_model_len: int | None = None
    """Context length; None asks the server (`/server_info` `context_length`)."""


class SGLangEngine(RemoteEngine):
    """Build with `await SGLangEngine.connect(config)`."""

    server: SupervisedServer | None = None
    """A server this engine launched (`engines.sglang_launch`); `close` stops it."""
    _model_path: Path | None = None
    """The directory the server was started on (`/model_info`, read at connect): its config
    files go beside in-process weights written for it."""

    async def close(self) -> None:
        await super().close()
        if self.server is not None:
            await self.server.stop()

    @classmethod
    async def connect(cls, config: SGLangEngineConfig) -> SGLangEngine:
        http = EngineHTTP(config.url, timeout=config.timeout)
        try:
            info = await http.get("/model_info", within=30)
            raise_for_status(info, "GET /model_info")
            max_len = config.max_model_len
            if max_len is None:
                server = await http.get("/server_info", within=30)
                raise_for_status(server, "GET /server_info")
                max_len = int(server.json()["context_length"])
        except BaseException:
            await http.close()
            raise
        engine = cls(
            config.url,
            max_model_len=max_len,
            version=labelled_version(info.json().get("weight_version"), config.version),
            base_version=config.version,
            vocab_size=config.vocab_size,
            timeout=config.timeout,
            http=http,
        )
        if info.json().get("model_path"):
            engine._model_path = Path(info.json()["model_path"])
        return engine

    # -- generation ---------------------------------------------------------------------------

    def _body(
        self, sub_id: str, prompt: tuple[int, ...], sampling: SamplingParams
    ) -> dict[str, Any]:
        params: dict[str, Any] = {
            "max_new_tokens": sampling.max_new_tokens,
            "min_new_tokens": sampling.min_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k or -1,  # SGLang: -1 disables
            "ignore_eos": sampling.ignore_eos,
            "stop_token_ids": list(sampling.stop_token_ids),
            "skip_special_tokens": False,
            "no_stop_trim": True,  # keep the stop token: it was sampled and is trained on
        }
        if sampling.seed is not None:
            params["sampling_seed"] = sampling.seed
        if sampling.json_schema is not None:
            params["json_schema"] = sampling.json_schema  # SGLang's grammar backend holds to it
        if sampling.grammar is not None:  # read as Lark under `--grammar-backend llguidance`
            params["ebnf"] = sampling.grammar
        return {
            "input_ids": list(prompt),
            "sampling_params": params,
            "return_logprob": True,
            "top_logprobs_num": sampling.top_logprobs,
            "rid": sub_id,
            "stream": True,
        }

    async def _submit(
        self, sub_id: str, prompt: tuple[int, ...], sampling: SamplingParams
    ) -> AsyncIterator[Piece]:
        body = self._body(sub_id, prompt, sampling)
        k = sampling.top_logprobs
        seen = 0
        async with self.http.stream("/generate", body) as response:
            if response.status >= 400:
                raise_for_status(await response.read(), "POST /generate")
            async for data in response.events():
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    raise EngineUnavailableError(f"SGLang stream error: {event['error']}")
                piece = _piece(event["meta_info"], seen, k)
                seen += len(piece.token_ids)
                yield piece

    async def _abort_sub(self, sub_id: str) -> None:
        await self.http.post("/abort_request", json={"rid": sub_id})

    # -- control ------------------------------------------------------------------------------

    async def _post(self, path: str, what: str, **kwargs: Any) -> Reply:
        response = await self.http.post(path, **kwargs)
        raise_for_status(response, what)
        return response

    async def _pause_server(self) -> None:
        await self._post("/pause_generation", "pause", json={"mode": "abort"})

    async def _resume_server(self) -> None:
        await self._post("/continue_generation", "continue", json={})

    async def _load_weights(self, update: WeightUpdate, version: int) -> None:
        if update.path is not None:
            await self._load_dir(update.path, version)
            return
        # An in-process state dict (`serve --train`): written as a model directory, the weights
        # beside the server's own config files, on a filesystem the server shares.
        from engines.weights import save_model_dir

        assert update.state_dict is not None
        if self._model_path is None:
            info = await self.http.get("/model_info", within=30)
            raise_for_status(info, "GET /model_info")
            self._model_path = Path(info.json()["model_path"])
        root = Path(tempfile.mkdtemp(prefix="rlgateway-weights-"))
        try:
            await asyncio.to_thread(
                save_model_dir, update.state_dict, root / "model", self._model_path
            )
            await self._load_dir(root / "model", version)
        finally:
            shutil.rmtree(root, ignore_errors=True)

    async def _load_dir(self, path: Path, version: int) -> None:
        body = {"model_path": str(path), "weight_version": str(version), "flush_cache": True}
        r = await self.http.post("/update_weights_from_disk", json=body)
        _check_success(r, f"load weights from {path}")
        await self._flush_cache()

    async def _flush_cache(self) -> None:
        for _ in range(100):  # 400 while requests are still running or waiting
            r = await self.http.post("/flush_cache")
            if r.status == 200:
                return
            await asyncio.sleep(0.05)
        raise WeightUpdateError("SGLang kept refusing to flush its cache")

    async def _weight_label(self) -> object:
        info = await self.http.get("/model_info", within=10)
        return info.json().get("weight_version") if info.status == 200 else NO_LABEL

    async def _probe(self) -> tuple[bool, int, int, str]:
        health = await self.http.get("/health", within=10)
        if health.status != 200:
            return False, 0, 0, f"/health answered {health.status}"
        loads = await self.http.get("/v1/loads", within=10)
        running = waiting = 0
        if loads.status == 200:
            for load in loads.json().get("loads", ()):
                running += int(load.get("num_running_reqs", 0))
                waiting += int(load.get("num_waiting_reqs", 0))
        return True, running, waiting, ""

    # -- the weight group: `/init_weights_update_group`, `/update_weights_from_distributed` ----

    async def weight_group_ranks(self) -> int:
        r = await self.http.get("/server_info", within=30)
        info = r.json() if r.status == 200 else {}
        return int(info.get("tp_size") or 1) * int(info.get("pp_size") or 1)

    async def _join_group(self, group: WeightGroup, rank_offset: int) -> None:
        """SGLang opens `torch.distributed`'s `group.backend` group over a TCPStore at the
        master address, its keys prefixed by the group's name (the trainer does the same)."""
        body = {
            "master_address": group.master_address,
            "master_port": group.master_port,
            "rank_offset": rank_offset,
            "world_size": group.world_size,
            "group_name": group.name,
            "backend": group.backend,
        }
        r = await self.http.post("/init_weights_update_group", json=body, within=group.timeout_s)
        _check_success(r, "join the weight update group")

    async def _receive(self, broadcast: Broadcast, group: WeightGroup, version: int) -> None:
        """One `/update_weights_from_distributed` per bucket while the trainer sends it (SGLang
        loads each bucket as it arrives); the last labels the version."""
        last = len(broadcast.buckets) - 1
        for i, bucket in enumerate(broadcast.buckets):
            body: dict[str, Any] = {
                "names": [t.name for t in bucket],
                "dtypes": [t.dtype for t in bucket],
                "shapes": [list(t.shape) for t in bucket],
                "group_name": group.name,
                "flush_cache": i == last,
            }
            if i == last:
                body["weight_version"] = str(version)
            r = await self.http.post(
                "/update_weights_from_distributed", json=body, within=group.timeout_s
            )
            _check_success(r, f"receive weights (bucket {i + 1} of {last + 1})")
        await self._flush_cache()


def _check_success(response: Reply, what: str) -> None:
    """SGLang's weight endpoints answer `{"success": bool, "message": str}` (400 on failure)."""
    try:
        body = response.json()
    except ValueError:
        body = {}
    if response.status != 200 or not body.get("success", False):
        message = body.get("message") or response.text[:500]
        raise WeightUpdateError(f"{what}: SGLang said: {message}")


def _piece(meta: dict[str, Any], seen: int, k: int) -> Piece:
    entries = meta.get("output_token_logprobs") or []
    new = int(meta.get("completion_tokens", seen + len(entries))) - seen
    fresh = entries[len(entries) - new :] if new > 0 else []
    ids = tuple(int(e[1]) for e in fresh)
    logprobs = tuple(float(e[0]) for e in fresh)
    tops: tuple[tuple[tuple[int, float], ...], ...] = ()
    if k and fresh:
        all_tops = meta.get("output_top_logprobs") or []
        tops = tuple(
            tuple((int(t[1]), float(t[0])) for t in step[:k])
            for step in all_tops[len(all_tops) - new :]
        )
    reason = meta.get("finish_reason")
    finish = _FINISH.get(reason["type"], FinishReason.STOP) if reason else None
    return Piece(ids, logprobs, tops, finish)
