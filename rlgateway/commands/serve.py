"""`rlgateway serve`: the gateway on the local engine (the tiny model unless --model is given)."""

from __future__ import annotations

import argparse
import logging
import secrets
from pathlib import Path
from typing import TYPE_CHECKING

from rlgateway.errors import CLIError

if TYPE_CHECKING:
    from gateway.settings import GatewaySettings
    from trainer.config import TrainConfig


def run_serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from gateway.settings import GatewaySettings

    overrides = {
        k: v
        for k, v in {
            "host": args.host,
            "port": args.port,
            "database_url": args.database_url,
            "admin_token": args.admin_token,
            "model": args.model,
            "served_model_name": args.served_model_name,
            "public_url": args.public_url,
            "device": args.device,
            "dtype": args.dtype,
            "max_batch": args.max_batch,
            "max_prefill_tokens": args.max_prefill_tokens,
            "engine_process": False if args.in_process_engine else None,
            "engine_threads": args.engine_threads,
            "engine": args.engine,
            "engine_urls": args.engine_urls,
            "engine_launch": args.engine_launch,
            "vllm_python": args.vllm_python,
            "sglang_python": args.sglang_python,
            "policy_version": args.policy_version,
            "tool_parser": args.tool_parser,
            "reasoning_parser": args.reasoning_parser,
        }.items()
        if v is not None
    }
    try:
        settings = GatewaySettings(**overrides)
    except ValidationError as exc:
        raise CLIError(
            f"bad setting: {exc.errors()[0]['loc'][0]}: {exc.errors()[0]['msg']}"
        ) from exc
    if settings.model is not None and not (Path(settings.model) / "config.json").is_file():
        raise CLIError(
            f"{settings.model} is not a Hugging Face model directory (no config.json): "
            "build one with `rlgateway model tiny DIR` or leave --model out for the tiny model"
        )
    _check_engine(settings)
    train = None
    if args.train:
        from trainer.config import load_config

        try:
            train = load_config(args.config, args.overrides)
        except ValueError as exc:
            raise CLIError(str(exc)) from exc
        train = train.model_copy(update={"database_url": settings.database_url})
        if train.publish.mode == "collective" and settings.engine == "local":
            raise CLIError(
                "publish.mode collective broadcasts to vLLM or SGLang servers (--engine vllm or "
                "sglang); the local engine takes the weights in process: leave publish.mode "
                "at disk"
            )
        if train.run:
            train = _adopt_run(train)
    elif args.config or args.overrides:
        raise CLIError("--config and KEY=VALUE overrides go with --train")
    from gateway.single import GatewayLockedError, sole_gateway

    try:  # said here, before anything loads; the gateway holds the claim while it serves
        with sole_gateway(settings.database_url):
            pass
    except GatewayLockedError as exc:
        raise CLIError(str(exc)) from exc
    made_up = not settings.admin_token
    if made_up:
        settings.admin_token = f"rlg-admin-{secrets.token_urlsafe(16)}"
        print(f"admin token (set RLGATEWAY_ADMIN_TOKEN to choose one): {settings.admin_token}")

    import uvicorn

    from gateway.serving import header_deadline
    from rlgateway.app import create_app

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    print(f"rlgateway serving on {settings.base_url()} (store: {_redacted(settings.database_url)})")
    print(_page_line(settings, made_up), flush=True)
    uvicorn.run(
        create_app(settings, train=train),
        host=settings.host,
        port=settings.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=5,
        # Longer than common clients' keep-alive (httpx: 5 s), so that the server never closes
        # an idle connection just as a client reuses it (a ReadError on the client).
        timeout_keep_alive=30,
        http=header_deadline(settings.header_timeout),
    )
    return 0


def _adopt_run(train: TrainConfig) -> TrainConfig:
    """`serve --train run=ID`: the config merged with the run's own, stored with the run
    (`rlgateway.run_merge`), before anything loads."""
    import asyncio

    from rlgateway.run_merge import adopt_run_config
    from store import NotFoundError, Store, StoreError

    async def adopt() -> TrainConfig:
        store = await Store.connect(train.database_url)
        try:
            await store.get_run(train.run)
            return await adopt_run_config(store, train)
        finally:
            await store.close()

    try:
        return asyncio.run(adopt())
    except NotFoundError as exc:
        raise CLIError(f"{exc}: create the run with POST /runs first, or leave run= out") from exc
    except (StoreError, ValueError) as exc:
        raise CLIError(str(exc)) from exc


def _check_engine(settings: GatewaySettings) -> None:
    if settings.engine == "local":
        if settings.engine_urls or settings.engine_launch:
            raise CLIError("--engine-url and --engine-launch go with --engine vllm or sglang")
        return
    if settings.engine_launch:
        if settings.engine_urls:
            raise CLIError("give either --engine-launch or --engine-url, not both")
    elif not settings.engine_urls:
        raise CLIError(
            f"--engine {settings.engine} needs --engine-url URL (a running server), "
            f"or --engine-launch to start a local {settings.engine} server"
        )


def _page_line(settings: GatewaySettings, made_up: bool) -> str:
    """Where the web page is. A token this command made up is already on the screen, so its link
    carries it (in the fragment, which the browser never sends); a token the user chose is not
    repeated."""
    page = f"{settings.base_url()}/ui"
    if made_up:
        return f"web page: {page}#token={settings.admin_token}"
    return f"web page: {page} (give it the admin token, or open {page}#token=TOKEN)"


def _redacted(url: str) -> str:
    from store.db import redact

    return redact(url)
