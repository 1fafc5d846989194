"""Connect to inference servers by kind: one server is its adapter, several get a `Router`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from engines.base import Engine
from engines.router import Router
from engines.sglang import SGLangEngine, SGLangEngineConfig
from engines.vllm import VLLMEngine, VLLMEngineConfig


async def _vllm(url: str, vocab_size: int | None, version: int) -> Engine:
    return await VLLMEngine.connect(
        VLLMEngineConfig(url=url, vocab_size=vocab_size, version=version)
    )


async def _sglang(url: str, vocab_size: int | None, version: int) -> Engine:
    return await SGLangEngine.connect(
        SGLangEngineConfig(url=url, vocab_size=vocab_size, version=version)
    )


SERVER_KINDS: dict[str, Callable[[str, int | None, int], Awaitable[Engine]]] = {
    "vllm": _vllm,
    "sglang": _sglang,
}


async def connect_servers(
    kind: str, urls: Sequence[str], vocab_size: int | None = None, version: int = 0
) -> Engine:
    """The engine for `urls` of `kind` ("vllm" or "sglang"); a started `Router` when several.
    `version`: the policy version of the weights the servers were started with
    (`engines.remote.RemoteEngineConfig.version`)."""
    if kind not in SERVER_KINDS:
        raise ValueError(f"engine kind must be one of {sorted(SERVER_KINDS)}, not {kind!r}")
    if not urls:
        raise ValueError(f"give at least one {kind} server URL")
    engines = [await SERVER_KINDS[kind](url, vocab_size, version) for url in urls]
    if len(engines) == 1:
        return engines[0]
    router = Router(list(zip(urls, engines, strict=True)))
    router.start()
    return router
