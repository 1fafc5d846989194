"""`rlgateway serve`: the gateway on the local engine (the tiny model unless --model is given)."""

from __future__ import annotations

import argparse
import logging
import secrets
from pathlib import Path

from gateway.cli import CLIError


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
            "max_batch": args.max_batch,
            "engine_process": False if args.in_process_engine else None,
            "engine_threads": args.engine_threads,
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
    train = None
    if args.train:
        from trainer.config import load_config

        try:
            train = load_config(args.config, args.overrides)
        except ValueError as exc:
            raise CLIError(str(exc)) from exc
        train = train.model_copy(update={"database_url": settings.database_url})
    elif args.config or args.overrides:
        raise CLIError("--config and KEY=VALUE overrides go with --train")
    if not settings.admin_token:
        settings.admin_token = f"rlg-admin-{secrets.token_urlsafe(16)}"
        print(f"admin token (set RLGATEWAY_ADMIN_TOKEN to choose one): {settings.admin_token}")

    import uvicorn

    from gateway.app import create_app

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    print(f"rlgateway serving on {settings.base_url()} (store: {_redacted(settings.database_url)})")
    uvicorn.run(
        create_app(settings, train=train),
        host=settings.host,
        port=settings.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=5,
    )
    return 0


def _redacted(url: str) -> str:
    from store.db import redact

    return redact(url)
