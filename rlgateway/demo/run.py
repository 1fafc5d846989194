"""`rlgateway demo`: the whole system on one machine, learning in minutes.

1. The demo-size tiny model (a few million parameters), warm-started by SFT on a sloppy
   teacher's demonstrations (`warmstart.py`; cached after the first run).
2. The gateway on loopback (local engine, SQLite in the output directory) as a real HTTP server.
3. The trainer in the background (GRPO unless `--algorithm` says otherwise), publishing each new
   policy straight into the engine while the agents keep running.
4. Many concurrent `openai`-SDK agents answering the task as GRPO groups, graded in code, with
   rewards posted over HTTP (`harness.py`), in a process of their own as a user's agents are.
5. A live table while it runs; reward.png and summary.json at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rlgateway.demo.harness import ADMIN_TOKEN_ENV, Episode
from rlgateway.demo.report import Progress, summarize, write_outputs
from rlgateway.demo.task import LONGEST_ANSWER, MAX_TOKENS
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
    "kl_coef": 0.05,
}
"""The default demo's GRPO knobs (BENCHMARKS.md, "The demo", has the runs that chose them): with
4 mini-batches per step the policy moves within a step, and the preset's 0.4 clip let it move
far enough to collapse; DAPO's clip-higher (0.2 / 0.28) and a dual clip bound each step. The KL
to the warm start in the loss (GRPO's own form: k3, in the loss) is what keeps the policy from
collapsing onto one string per instruction: the reward does not care which letters are written,
so the KL keeps them varied while the length is learned, and uniform groups stay rare."""


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
    from gateway.serving import EmbeddedServer
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
    cfg = None
    run_config: dict[str, Any] = {"task": "exact-length lowercase letters", "trained": o.train}
    if o.train:
        cfg = train_config(o, "", database_url)
        run_config |= cfg.model_dump(mode="json", exclude={"run", "database_url"})
    run = await c.store.create_run("demo" if o.train else "demo (no training)", run_config)
    progress = Progress(window=o.group_size * o.groups_per_step)
    server = EmbeddedServer(
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
    agents: AgentsProcess | None = None
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
        agents = await AgentsProcess.start(
            url, settings.admin_token, run.id, o, on_episode=progress.on_episode
        )
        progress.start()
        t0 = time.perf_counter()
        working = asyncio.create_task(agents.read(c.engine.version))
        # The clock ends the demo, or the trainer reaching max_steps (an override), or a failure.
        watched = [working] + ([trainer.task] if trainer is not None else [])
        await asyncio.wait(watched, timeout=o.minutes * 60, return_when=asyncio.FIRST_COMPLETED)
        await agents.stop()
        await working
        if trainer is not None and trainer.task.done() and not trainer.task.cancelled():
            trainer.task.result()  # raises what stopped the trainer, if anything did
    finally:
        seconds = time.perf_counter() - t0
        steps = trainer.trainer.step if trainer is not None else 0
        if agents is not None:
            await agents.close()
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


class AgentsProcess:
    """The agents (`python -m rlgateway.demo.harness`) as a child process: its episodes, one
    JSON line each, are handed to `on_episode` with the policy version serving when they
    arrive. Its stdin is a pipe held open, so it stops if this process dies."""

    def __init__(
        self, proc: asyncio.subprocess.Process, on_episode: Callable[[Episode], None]
    ) -> None:
        self.proc = proc
        self.on_episode = on_episode

    @classmethod
    async def start(
        cls,
        url: str,
        admin_token: str,
        run_id: str,
        o: DemoOptions,
        *,
        on_episode: Callable[[Episode], None],
    ) -> AgentsProcess:
        args = ["--url", url, "--run", run_id, "--model", "demo"]
        args += ["--group-size", str(o.group_size), "--workers", str(o.workers)]
        args += ["--seed", str(o.seed)]
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "rlgateway.demo.harness",
            *args,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env={**os.environ, ADMIN_TOKEN_ENV: admin_token},
            limit=1 << 20,
        )
        return cls(proc, on_episode)

    async def read(self, version: Callable[[], int]) -> None:
        """Episodes until the process exits; raises if it failed."""
        assert self.proc.stdout is not None
        async for line in self.proc.stdout:
            self.on_episode(replace(Episode.from_json(line.decode()), version=version()))
        code = await self.proc.wait()
        if code != 0:
            raise RuntimeError(f"the demo's agents exited with status {code} (their stderr above)")

    async def stop(self) -> None:
        """Ask the agents to finish the groups they started, then exit."""
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
                self.proc.terminate()

    async def close(self, grace: float = 30.0) -> None:
        """Stop the agents and wait for them; kill them if they outstay `grace` seconds."""
        await self.stop()
        try:
            await asyncio.wait_for(self.proc.wait(), grace)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
