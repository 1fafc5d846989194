"""`rlgateway train --config FILE [KEY=VALUE ...]`: the trainer as its own process(es).

The run owns its config (`rlgateway.run_merge`): a setting the run's stored config and this
config both give must agree, the run's fill in what this one leaves out, and the merged config is
stored with the run, so the gateway admits the run's agents by the trainer's `eta` and
`batch_size`."""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

from rlgateway.errors import CLIError


def run_train(args: argparse.Namespace) -> int:
    from trainer.config import load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except ValueError as exc:
        raise CLIError(str(exc)) from exc
    if not cfg.run:
        raise CLIError("the config names no run: set `run: RUN_ID` (from POST /runs) or run=ID")
    token = args.admin_token or os.environ.get("RLGATEWAY_ADMIN_TOKEN")
    if args.gateway_url and not token:
        raise CLIError(
            "--gateway-url needs the gateway's admin token: --admin-token or RLGATEWAY_ADMIN_TOKEN"
        )
    code = asyncio.run(_train(cfg, args.gateway_url, token))
    # this rank's collectives are done and the trainer is dropped: free the process groups
    # while the interpreter is intact (their threads must not outlive it)
    from trainer.backends.fsdp import shutdown_distributed

    shutdown_distributed()
    return code


async def _train(cfg: object, gateway_url: str | None, token: str | None) -> int:
    import logging

    from rlgateway.build import build_publisher, build_trainer, model_dir_of
    from rlgateway.run_merge import adopt_run_config
    from store import Store
    from store.errors import StoreError
    from trainer.collective import AdminSink
    from trainer.config import TrainConfig
    from trainer.publish import DiskPublisher, GatewayAdmin

    assert isinstance(cfg, TrainConfig)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        store = await Store.connect(cfg.database_url)
    except StoreError as exc:
        raise CLIError(str(exc)) from exc
    try:
        try:
            await store.get_run(cfg.run)
        except StoreError as exc:
            raise CLIError(f"{exc}: create the run with POST /runs first") from exc
        try:  # the run's own settings win; the gateway admits by what this trainer trains by
            cfg = await adopt_run_config(store, cfg)
        except ValueError as exc:
            raise CLIError(str(exc)) from exc
        model_dir = model_dir_of(cfg)
        publisher = None
        try:
            if gateway_url:
                assert token is not None
                admin = GatewayAdmin(gateway_url, token)
                weights_dir = Path(cfg.checkpoint_dir) / "published"
                disk = DiskPublisher(
                    weights_dir,
                    model_dir,
                    admin,
                    keep=cfg.publish.keep,
                    bucket_bytes=cfg.publish.bucket_bytes,
                )
                publisher = build_publisher(cfg, disk, AdminSink(admin))
            elif cfg.publish.mode != "disk":
                raise ValueError("publish.mode collective needs a gateway: give --gateway-url")
            trainer = await build_trainer(cfg, store, publisher, model_dir)
        except ValueError as exc:  # e.g. wandb configured but not installed; a foreign checkpoint
            raise CLIError(str(exc)) from exc
        print(
            f"training run {cfg.run} from step {trainer.step} to {cfg.max_steps} "
            f"(policy version {trainer.version}; eta {cfg.eta}, batch_size {cfg.batch_size})",
            flush=True,
        )
        try:
            await trainer.run()
        finally:
            trainer.close()
    finally:
        await store.close()
    return 0
