"""Gateway components on vLLM/SGLang servers (`rlgateway serve --engine vllm|sglang`).

The gateway still owns tokenization: it loads the tokenizer (and the end-of-turn ids) from the
model directory (`--model`, else the tiny model), which must be the model the servers serve; the
servers start at that directory's policy version (`engines.policy.served_version`).
With `--engine-launch` it starts and supervises a local vLLM or SGLang server on that directory
first.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engines.base import Engine

if TYPE_CHECKING:
    from engines.launch import SupervisedServer
    from engines.sglang import SGLangEngine
    from engines.vllm import VLLMEngine
    from gateway.deps import Components
    from gateway.settings import GatewaySettings


def eos_token_ids(model_dir: Path) -> frozenset[int]:
    """The model's end ids, from config.json and generation_config.json, as the engines use."""
    import json

    eos: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = model_dir / name
        if path.is_file():
            ids = json.loads(path.read_text()).get("eos_token_id")
            eos.update([ids] if isinstance(ids, int) else ids or [])
    return frozenset(eos)


async def connect_engine(settings: GatewaySettings, model_dir: Path, vocab_size: int) -> Engine:
    from engines.policy import served_version
    from engines.servers import connect_servers

    # httpx logs every request at INFO, and the vLLM launcher polls /health with it each second.
    logging.getLogger("httpx").setLevel(logging.WARNING)

    version = served_version(model_dir, settings.policy_version)
    if not settings.engine_launch:
        return await connect_servers(settings.engine, settings.engine_urls, vocab_size, version)
    common: dict[str, Any] = {
        "model": str(model_dir),
        "served_model_name": settings.served_model_name or model_dir.name,
        "max_model_len": settings.max_model_len,
        "dtype": settings.dtype,
    }
    server: SupervisedServer
    connect: Callable[[str], Awaitable[VLLMEngine | SGLangEngine]]
    if settings.engine == "sglang":
        from engines.sglang import SGLangEngine, SGLangEngineConfig
        from engines.sglang_launch import SGLangLaunchConfig, SGLangServer

        python = settings.sglang_python or sys.executable
        server = SGLangServer(SGLangLaunchConfig(python=python, **common))

        def connect(url: str) -> Awaitable[SGLangEngine]:
            cfg = SGLangEngineConfig(url=url, vocab_size=vocab_size, version=version)
            return SGLangEngine.connect(cfg)
    else:
        from engines.vllm import VLLMEngine, VLLMEngineConfig
        from engines.vllm_launch import VLLMLaunchConfig, VLLMServer

        assert settings.engine == "vllm", "validated by the CLI"
        python = settings.vllm_python or sys.executable
        server = VLLMServer(VLLMLaunchConfig(python=python, **common))

        def connect(url: str) -> Awaitable[VLLMEngine]:
            return VLLMEngine.connect(
                VLLMEngineConfig(url=url, vocab_size=vocab_size, version=version)
            )

    await server.start()
    try:
        engine = await connect(server.url)
    except BaseException:
        await server.stop()
        raise
    engine.server = server
    return engine


async def load_remote_components(settings: GatewaySettings) -> Components:
    from gateway.core.tokenizer import load_chat_tokenizer
    from gateway.deps import Components
    from store import Store

    if settings.model:
        model_dir = Path(settings.model)
    else:  # the tiny model's build needs torch: a light gateway names its model
        from engines.tiny_model import tiny_model_dir

        model_dir = tiny_model_dir()
    tokenizer = load_chat_tokenizer(model_dir)
    engine = await connect_engine(settings, model_dir, len(tokenizer))
    try:
        store = await Store.connect(settings.database_url)
    except BaseException:
        await engine.close()
        raise
    return Components(
        engine=engine,
        store=store,
        tokenizer=tokenizer,
        eos_token_ids=eos_token_ids(model_dir),
        model_name=settings.served_model_name or model_dir.name,
    )
