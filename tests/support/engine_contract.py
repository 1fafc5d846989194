"""The engines the engine contract suite (`tests/integration/engines/test_engine_contract.py`)
runs over, each on the tiny model: what every `engines.base.Engine` must do the same way.

- `local`: `LocalEngine` in this process;
- `process`: the same engine in a process of its own (`ProcessEngine`);
- `router`: a `Router` over two local engines;
- `fake_vllm`, `fake_sglang`: the vLLM and SGLang adapters against the fake servers
  (`tests/support/fake_vllm.py`, `fake_sglang.py`: the servers' HTTP shapes, real generation).

A `Subject` holds what is costly (an engine process, a server, a loaded model) for a test module
and hands each test an engine of its own over it (`open`, given back with `release`): adapters
and routers hold asyncio state, and every test runs on an event loop of its own. Tests that close
an engine ask for one that shares nothing (`own`).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import torch

from engines.base import Engine, EngineHealth, GenerateRequest, TokenChunk, WeightUpdate
from engines.local import LocalEngine, LocalEngineConfig
from engines.process import ProcessEngine
from engines.router import Router
from engines.sglang import SGLangEngine, SGLangEngineConfig
from engines.vllm import VLLMEngine, VLLMEngineConfig
from tests.support.fake_sglang import run_fake_sglang
from tests.support.fake_vllm import run_fake_vllm

KINDS = ("local", "process", "router", "fake_vllm", "fake_sglang")


class Shared:
    """An engine that a router may close without closing it: the module's engines outlive each
    test's router."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        return self.engine.generate(request)

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def pause(self) -> None:
        await self.engine.pause()

    async def resume(self) -> None:
        await self.engine.resume()

    async def update_weights(self, update: WeightUpdate) -> int:
        return await self.engine.update_weights(update)

    def version(self) -> int:
        return self.engine.version()

    async def health(self) -> EngineHealth:
        return await self.engine.health()

    async def close(self) -> None:
        pass


class Subject:
    def __init__(self, kind: str, model_dir: Path, stack: contextlib.ExitStack) -> None:
        self.kind = kind
        self.model_dir = model_dir
        self.vocab_size = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
        self._shared: list[Engine] = []
        self._url = ""
        config = LocalEngineConfig(model=str(model_dir))
        if kind == "local":
            self._shared = [LocalEngine.load(config)]
        elif kind == "process":
            self._shared = [ProcessEngine.load(config)]
        elif kind == "router":
            self._shared = [LocalEngine.load(config), LocalEngine.load(config)]
        elif kind == "fake_vllm":
            self._url = stack.enter_context(run_fake_vllm(model_dir)).url
        elif kind == "fake_sglang":
            self._url = stack.enter_context(run_fake_sglang(model_dir)).url
        else:
            raise ValueError(f"no engine kind {kind!r}")

    async def open(self) -> Engine:
        """An engine for one test over the module's model, process or server."""
        if self.kind in ("local", "process"):
            return self._shared[0]
        if self.kind == "router":
            return Router([(f"local-{i}", Shared(e)) for i, e in enumerate(self._shared)])
        return await self._connect()

    async def release(self, engine: Engine) -> None:
        if self.kind not in ("local", "process"):
            await engine.close()

    async def own(self) -> Engine:
        """An engine that shares nothing the module's tests use: the test closes it."""
        config = LocalEngineConfig(model=str(self.model_dir))
        if self.kind == "local":
            return LocalEngine.load(config)
        if self.kind == "process":
            return ProcessEngine.load(config)
        if self.kind == "router":
            return Router([(f"own-{i}", LocalEngine.load(config)) for i in range(2)])
        return await self._connect()  # an adapter of its own; the server goes on

    async def _connect(self) -> Engine:
        if self.kind == "fake_vllm":
            return await VLLMEngine.connect(
                VLLMEngineConfig(url=self._url, vocab_size=self.vocab_size)
            )
        return await SGLangEngine.connect(
            SGLangEngineConfig(url=self._url, vocab_size=self.vocab_size)
        )

    async def close(self) -> None:
        for engine in self._shared:
            await engine.close()


class Teacher:
    """Teacher-forced log-probabilities of a model directory, loaded once (float32, double
    softmax): what every engine's logprobs must equal."""

    def __init__(self) -> None:
        self._models: dict[Path, Any] = {}

    def logprobs(self, model_dir: Path, tokens: Sequence[int], temperature: float) -> torch.Tensor:
        """Row t: log_softmax(logits / temperature) of the token after tokens[: t + 1]."""
        from transformers import AutoModelForCausalLM

        if model_dir not in self._models:
            self._models[model_dir] = AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=torch.float32
            ).eval()
        with torch.no_grad():
            logits = self._models[model_dir](torch.tensor([list(tokens)])).logits[0].double()
        return torch.log_softmax(logits / (temperature or 1.0), dim=-1)

    def picked(
        self, model_dir: Path, prompt: Sequence[int], output: Sequence[int], temperature: float
    ) -> list[float]:
        """The logprob of each output token given everything before it."""
        logp = self.logprobs(model_dir, [*prompt, *output], temperature)
        rows = logp[len(prompt) - 1 : -1]
        return [rows[i, t].item() for i, t in enumerate(output)]
