"""The FastAPI application: wiring only. Routes live in `gateway/routes/`, one module per
resource, and in each protocol's package (`gateway/protocols/*/routes.py`).

`create_app(settings)` builds the engine, store and tokenizer in its lifespan (what `rlgateway
serve` does) and loads the store's newest published policy into the engine before it serves
(`gateway.published`); tests and embedders pass ready-made components with
`create_app(settings, components=...)` and keep ownership of them (and of the weights their
engine serves). The gateway knows nothing of the trainer: the composition layer
(`rlgateway.app`) passes the trainer's run-config check and, for `serve --train`, the embedded
trainer as a sidecar.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from gateway.deps import (
    Components,
    GatewayDep,
    RunConfigCheck,
    build_gateway,
    check_run_fields,
)
from gateway.errors import document_envelopes, install_error_handlers
from gateway.limits import BodyLimit
from gateway.metrics import GatewayMetrics, RequestMetrics, engine_health
from gateway.published import follow_policy, restore_policy
from gateway.settings import GatewaySettings
from store import Store

Sidecar = Callable[[Components, GatewaySettings], AbstractAsyncContextManager[Any]]
"""Something that runs beside the gateway for the app's lifetime, on its components (the
embedded trainer of `rlgateway serve --train`): entered after the components are up, left before
they close."""

log = logging.getLogger(__name__)


async def load_components(settings: GatewaySettings) -> Components:
    """The local engine on the configured model (the tiny model by default) at its policy version
    (`engines.policy.served_version`), in its own process unless `settings.engine_process` is
    off, and the store."""
    import asyncio

    if settings.engine != "local":
        from gateway.remote_engine import load_remote_components

        return await load_remote_components(settings)

    from engines.local import LocalEngine, LocalEngineConfig
    from engines.policy import served_version
    from engines.process import ProcessEngine
    from engines.tiny_model import tiny_model_dir
    from gateway.core.tokenizer import load_chat_tokenizer

    model_dir = Path(settings.model) if settings.model else tiny_model_dir()
    config = LocalEngineConfig(
        model=str(model_dir),
        device=settings.device,
        dtype=settings.dtype,
        max_batch=settings.max_batch,
        max_prefill_tokens=settings.max_prefill_tokens,
        max_model_len=settings.max_model_len,
        version=served_version(model_dir, settings.policy_version),
    )
    engine: LocalEngine | ProcessEngine
    if settings.engine_process:
        engine = await asyncio.to_thread(
            ProcessEngine.load, config, threads=settings.engine_threads
        )
    else:
        engine = await asyncio.to_thread(LocalEngine.load, config)
    store = await Store.connect(settings.database_url)
    return Components(
        engine=engine,
        store=store,
        tokenizer=load_chat_tokenizer(model_dir),
        eos_token_ids=engine.eos_token_ids,
        model_name=settings.served_model_name or model_dir.name,
    )


def create_app(
    settings: GatewaySettings,
    components: Components | None = None,
    *,
    check_run_config: RunConfigCheck = check_run_fields,
    sidecars: Sequence[Sidecar] = (),
) -> FastAPI:
    """The gateway. Without `components` it loads the engine and store from `settings` in its
    lifespan and closes them at the end; with them, the caller keeps ownership.
    `check_run_config` validates `POST /runs` configs; `sidecars` run for the app's lifetime."""
    from contextlib import AsyncExitStack, nullcontext

    from gateway.protocols.anthropic import routes as messages
    from gateway.protocols.openai import routes as openai
    from gateway.protocols.responses import routes as responses
    from gateway.routes import (
        admin,
        engines,
        export,
        prometheus,
        run_sessions,
        runs,
        sessions,
        training,
        ui,
    )
    from gateway.routes.generate import mount_protocol
    from gateway.single import sole_gateway

    metrics = GatewayMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        owned = components is None
        # one gateway per SQLite file (gateway/single.py), claimed before the engine loads
        with sole_gateway(settings.database_url) if owned else nullcontext():
            c = components if components is not None else await load_components(settings)
            try:
                if owned:
                    # before the server reports ready or admits a session (uvicorn serves
                    # nothing until the lifespan starts up): agents sample the newest policy
                    await restore_policy(c.engine, c.store)
                app.state.gateway = build_gateway(settings, c, metrics, check_run_config)
                async with AsyncExitStack() as stack:
                    if owned and c.store.shared and settings.policy_poll_seconds:
                        follow = asyncio.create_task(
                            follow_policy(c.engine, c.store, settings.policy_poll_seconds)
                        )
                        stack.callback(follow.cancel)
                    for sidecar in sidecars:
                        await stack.enter_async_context(sidecar(c, settings))
                    yield
            finally:
                if owned:
                    await c.engine.close()
                    await c.store.close()

    app = FastAPI(
        title="rlgateway",
        summary="OpenAI-compatible gateway that records every token for RL",
        lifespan=lifespan,
        # /docs is the gateway's own page (gateway/routes/ui.py): nothing loaded from a CDN
        docs_url=None,
        redoc_url=None,
    )
    install_error_handlers(app)
    document_envelopes(app)
    for protocol in (openai, responses, messages):
        mount_protocol(app, protocol.router)
    app.include_router(runs.router)
    app.include_router(sessions.router)
    app.include_router(admin.router)
    for r in (run_sessions, training, export, engines, prometheus, ui):
        app.include_router(r.router)

    @app.get("/health", include_in_schema=False)
    async def health(gw: GatewayDep) -> JSONResponse:
        """Readiness: 200 while the engine can serve, 503 (with the reason) while it cannot."""
        h = await engine_health(gw.engine)
        body: dict[str, Any] = {
            "ok": h.ok,
            "version": h.version,
            "paused": h.paused,
            "running": h.running,
            "waiting": h.waiting,
            "restarts": h.restarts,
            "parsers": gw.parsers.shown(),
        }
        if not h.ok:
            body["reason"] = h.detail
        return JSONResponse(body, status_code=200 if h.ok else 503)

    @app.get("/health/live", include_in_schema=False)
    async def live() -> dict[str, Any]:
        """Liveness: 200 while this process serves HTTP, whatever the engine's state."""
        return {"ok": True}

    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    app.add_middleware(RequestMetrics, metrics=metrics)
    return app
