"""`rlgateway demo`: the whole system on one machine, learning in minutes.

1. The demo-size tiny model (a few million parameters), warm-started by SFT on a sloppy
   teacher's demonstrations (`warmstart.py`; cached after the first run).
2. The gateway on loopback (local engine, SQLite in the output directory) as a real HTTP server.
3. The trainer in the background (GRPO unless `--algorithm` says otherwise), publishing each new
   policy straight into the engine while the agents keep running.
4. Many concurrent `openai`-SDK agents answering the task as GRPO groups, graded in code, with
   rewards posted over HTTP (`harness.py`).
5. A live table while it runs; reward.png and summary.json at the end.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlgateway.demo.harness import Agents
from rlgateway.demo.report import Progress, summarize, write_outputs
from rlgateway.demo.task import LONGEST_ANSWER, MAX_TOKENS, all_problems
from store.types import RunStatus


@dataclass(frozen=True, slots=True)
class DemoOptions:
    model_dir: Path
    """The policy to start from (the warm-started tiny model by default)."""
    out: Path
    train: bool
    minutes: float
    seed: int
    algorithm: str
    lr: float
    group_size: int
    groups_per_step: int
    eta: int
    workers: int
    """Concurrent agent workers; each runs one GRPO group (group_size agents) at a time."""
    overrides: tuple[str, ...] = ()
    """Extra run-config overrides (KEY=VALUE), as `rlgateway train` takes them."""
    engine: dict[str, Any] = field(default_factory=dict)
    """Engine settings for the gateway (`engine`, `engine_urls`, ...; see GatewaySettings)."""


DEMO_GRPO: dict[str, Any] = {
    "eps_low": 0.2,
    "eps_high": 0.28,
    "dual_clip_c": 3.0,
    "entropy_coef": 0.001,
}
"""The default demo's GRPO knobs (BENCHMARKS.md, "The demo", has the runs that chose them): with
4 mini-batches per step the policy moves within a step, and the preset's 0.4 clip let it move
far enough to collapse; DAPO's clip-higher (0.2 / 0.28), a dual clip and a small entropy bonus
kept it learning."""


def train_config(o: DemoOptions, run_id: str, database_url: str) -> Any:
    from trainer.config import apply_overrides, validate_config

    data: dict[str, Any] = {
        "run": run_id,
        "database_url": database_url,
        "model": str(o.model_dir),
        "algorithm": o.algorithm,
        "optim": {"lr": o.lr, "seed": o.seed},
        "batch_size": o.group_size * o.groups_per_step,
        "group_size": o.group_size,
        "eta": o.eta,
        "max_steps": 1_000_000,  # the clock ends the demo
        "temperature": 1.0,
        "max_tokens": MAX_TOKENS,
        "checkpoint_dir": str(o.out / "checkpoints"),
        "keep_checkpoints": 1,
    }
    from trainer.algorithms.config import PRESETS

    if o.algorithm == "grpo":
        data["algo"] = dict(DEMO_GRPO)
    if PRESETS[o.algorithm].overlong_buffer is not None:
        # DAPO's overlong penalty must spare every right answer: the longest is LONGEST_ANSWER
        # tokens (seven letters and the end token), so only the tokens past it are penalised.
        data["algo"] = {"overlong_buffer": MAX_TOKENS - LONGEST_ANSWER}
    try:
        data = apply_overrides(data, list(o.overrides))
    except ValueError as exc:
        raise ValueError(f"override: {exc}") from None
    return validate_config(data, "override")


async def run_demo(o: DemoOptions) -> dict[str, Any]:
    import uvicorn

    from gateway.app import load_components
    from gateway.settings import GatewaySettings
    from rlgateway.app import create_app
    from rlgateway.embedded import EmbeddedTrainer

    o.out.mkdir(parents=True, exist_ok=True)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    db_path = (o.out / "demo.db").resolve()
    database_url = f"sqlite:///{db_path}"
    settings = GatewaySettings(
        database_url=database_url,
        admin_token=f"rlg-admin-{secrets.token_urlsafe(12)}",
        model=str(o.model_dir),
        host="127.0.0.1",
        port=port,
        served_model_name="demo",
        **o.engine,
    )
    assert settings.admin_token is not None
    c = await load_components(settings)
    problems = all_problems()
    cfg = None
    run_config: dict[str, Any] = {"task": "exact-length lowercase letters", "trained": o.train}
    if o.train:
        cfg = train_config(o, "", database_url)
        run_config |= cfg.model_dump(mode="json", exclude={"run", "database_url"})
    run = await c.store.create_run("demo" if o.train else "demo (no training)", run_config)
    progress = Progress(window=o.group_size * o.groups_per_step)
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(settings, components=c),
            log_level="warning",
            lifespan="on",
            # Longer than the clients' keep-alive (httpx: 5 s), so that the server never closes
            # a connection a client is about to reuse.
            timeout_keep_alive=30,
        )
    )
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    trainer: EmbeddedTrainer | None = None
    t0 = time.perf_counter()
    try:
        while not server.started:
            if serving.done():
                await serving  # raises what stopped the server
                raise RuntimeError("the gateway stopped while starting")
            await asyncio.sleep(0.05)
        url = settings.base_url()
        print(f"gateway on {url} · run {run.id} · store {db_path}", flush=True)
        if cfg is not None:
            cfg = cfg.model_copy(update={"run": run.id})
            trainer = await EmbeddedTrainer.start(cfg, c, settings, report=progress.on_train_step)
        agents = Agents(
            gateway_url=url,
            admin_token=settings.admin_token,
            run_id=run.id,
            model="demo",
            problems=problems,
            group_size=o.group_size,
            workers=o.workers,
            seed=o.seed,
            version=c.engine.version,
            on_episode=progress.on_episode,
        )
        stop = asyncio.Event()
        progress.start()
        t0 = time.perf_counter()
        working = asyncio.create_task(agents.run(stop))
        # The clock ends the demo, or the trainer reaching max_steps (an override), or a failure.
        watched = [working] + ([trainer.task] if trainer is not None else [])
        await asyncio.wait(watched, timeout=o.minutes * 60, return_when=asyncio.FIRST_COMPLETED)
        stop.set()
        await working
        if trainer is not None and trainer.task.done() and not trainer.task.cancelled():
            trainer.task.result()  # raises what stopped the trainer, if anything did
    finally:
        seconds = time.perf_counter() - t0
        steps = trainer.trainer.step if trainer is not None else 0
        if trainer is not None:
            await trainer.stop()
        # the demo is over, and so is its run: it takes no new sessions, and nothing trains it
        await c.store.set_run_status(run.id, RunStatus.STOPPED)
        server.should_exit = True
        await serving
        await c.engine.close()
        await c.store.close()
    summary = summarize(progress.rows, trained=o.train, seconds=seconds, steps=steps)
    summary |= {
        "run_id": run.id,
        "database_url": database_url,
        "model": str(o.model_dir),
        "checkpoints": str(o.out / "checkpoints") if o.train else None,
    }
    title = f"rlgateway demo: {o.algorithm if o.train else 'no training'}, seed {o.seed}"
    summary["png"] = str(write_outputs(o.out, summary, title))
    return summary
