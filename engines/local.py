"""The embedded local engine: a transformers model in this process with continuous batching.

`LocalEngine` is the asyncio face (`engines.base.Engine`) of `engines.local_worker.LocalWorker`, the
thread that owns the model and schedules it (its docstring: steps, weight swaps, fault
containment). Each event loop that streams from it gets one consumer, which the worker feeds with
one `call_soon_threadsafe` per step.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engines.base import EngineHealth, GenerateRequest, TokenChunk, WeightUpdate
from engines.errors import InvalidRequestError
from engines.limits import check_local_request
from engines.local_worker import EngineStats, LocalWorker, _Item


@dataclass(frozen=True, slots=True, kw_only=True)
class LocalEngineConfig:
    model: str
    """A Hugging Face model directory (see `rlgateway model tiny`)."""
    device: str | None = None
    """`cpu`, `cuda`, `cuda:1`...; None picks CUDA when present."""
    dtype: str = "auto"
    """`float32`, `bfloat16`, `float16`; auto is float32 on CPU and bfloat16 on CUDA."""
    max_batch: int = 64
    """Sequences decoded together; more wait for a free slot."""
    max_model_len: int | None = None
    """Context length (prompt + output); None uses the model's max_position_embeddings."""
    max_prefill_tokens: int = 512
    """Prompt tokens one step prefills at most (a longer prompt alone): the rest wait for the
    next step, so live sequences decode and weight updates land between the parts of a burst."""
    version: int = 0
    """The policy version of the model's weights: tokens sampled before the first weight update
    carry it, and updates must be newer (`engines.policy.served_version` reads an export's)."""


class LocalEngine:
    """Implements `engines.base.Engine` in-process. Build with `LocalEngine.load(config)`."""

    def __init__(self, model: Any, config: LocalEngineConfig, eos_token_ids: frozenset[int]):
        self.config = config
        self.worker = LocalWorker(
            model,
            model_dir=config.model,
            max_batch=config.max_batch,
            max_model_len=config.max_model_len or int(model.config.max_position_embeddings),
            max_prefill_tokens=config.max_prefill_tokens,
            version=config.version,
            eos_token_ids=eos_token_ids,
        )
        self.model = model
        self.max_model_len = self.worker.max_model_len
        self.runner = self.worker.runner
        self.eos_token_ids = eos_token_ids
        self.grammars = self.worker.grammars
        self.stats: EngineStats = self.worker.stats
        self._consumers_lock = threading.Lock()
        self._consumers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopConsumer] = (
            weakref.WeakKeyDictionary()
        )

    @classmethod
    def load(cls, config: LocalEngineConfig) -> LocalEngine:
        from transformers import AutoModelForCausalLM, GenerationConfig
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]

        device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype_name = config.dtype
        if dtype_name == "auto":
            dtype_name = "float32" if device == "cpu" else "bfloat16"
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        if dtype_name not in dtype:
            raise ValueError(
                f"dtype must be auto, float32, bfloat16 or float16, not {dtype_name!r}"
            )
        model: Any = AutoModelForCausalLM.from_pretrained(config.model, dtype=dtype[dtype_name])
        model.to(device).eval()
        eos: set[int] = set()
        sources: list[Any] = [model.config]
        if (Path(config.model) / "generation_config.json").exists():
            sources.append(GenerationConfig.from_pretrained(config.model))
        for source in sources:
            ids = source.eos_token_id
            eos.update([ids] if isinstance(ids, int) else ids or [])
        return cls(model, config, frozenset(eos))

    # -- the Engine protocol -----------------------------------------------------------------

    def version(self) -> int:
        return self.worker.version()

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        self.check(request)
        return self._stream(request)

    def check(self, request: GenerateRequest) -> None:
        """Raise the `InvalidRequestError` that `generate` would raise for `request`."""
        check_local_request(
            request, max_model_len=self.max_model_len, vocab_size=self.runner.vocab_size
        )

    async def _stream(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        loop = asyncio.get_running_loop()
        with self._consumers_lock:
            consumer = self._consumers.get(loop)
            if consumer is None:
                consumer = self._consumers[loop] = _LoopConsumer(loop)
        queue: asyncio.Queue[_Item] = asyncio.Queue()
        if consumer.queues.setdefault(request.request_id, queue) is not queue:
            # the live request's queue stays: replacing it would leave that request unanswered
            raise InvalidRequestError(f"request id {request.request_id!r} is already live")
        try:
            self.worker.submit(request, consumer)
        except BaseException:
            del consumer.queues[request.request_id]
            raise
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finish_reason is not None
                yield item
        finally:
            if not finished:
                await self.abort(request.request_id)

    async def abort(self, request_id: str) -> None:
        self.worker.abort_now(request_id)

    async def pause(self) -> None:
        self.worker.set_paused(True)
        # Returns once the step in progress (if any) has finished.
        await asyncio.to_thread(self.worker.wait_step)

    async def resume(self) -> None:
        self.worker.set_paused(False)

    async def update_weights(self, update: WeightUpdate) -> int:
        return await asyncio.wrap_future(self.worker.submit_update(update))

    async def health(self) -> EngineHealth:
        return self.worker.health_now()

    async def close(self) -> None:
        await asyncio.to_thread(self.worker.close_now)


class _LoopConsumer:
    """The asyncio consumer of one event loop: the queues of that loop's live requests, fed in
    one `call_soon_threadsafe` per step."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queues: dict[str, asyncio.Queue[_Item]] = {}

    def deliver(self, items: list[tuple[str, _Item]]) -> None:
        # A closed loop raises RuntimeError: its consumer is gone and nobody is listening.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self._put, items)

    def _put(self, items: list[tuple[str, _Item]]) -> None:
        for request_id, item in items:
            queue = self.queues[request_id]
            if isinstance(item, BaseException) or item.finish_reason is not None:
                del self.queues[request_id]
            queue.put_nowait(item)
