"""Where an experiment's rollouts go: a deployment it starts itself, or one already running.

- `LocalDeployment`: the gateway on loopback (local engine in its own process, SQLite in the
  output folder) and the trainer as its background task, as `rlgateway serve --train` runs
  them; the run and its evaluation run are remembered in `DIR/experiment.json`, so running the
  spec again into the same folder resumes both (the trainer from its newest checkpoint).
- `RemoteDeployment` (`--gateway-url`): a running gateway whose trainer (`rlgateway train` or
  `serve --train`) trains the run; the experiment creates the run with the spec's config
  (unless given one) and follows its training through `GET /runs/{id}/metrics`.

Both answer the same few questions (`Deployment`); the experiment speaks only public HTTP to
either, through `GatewayClient`.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from rlgateway.experiment.client import GatewayClient
from trainer.config import TrainConfig

STATE_FILE = "experiment.json"


class Deployment(Protocol):
    client: GatewayClient
    run_id: str
    eval_run_id: str
    served_model_name: str

    def trained_step(self) -> int:
        """The newest step the trainer finished."""
        ...

    def training_over(self) -> bool:
        """The trainer reached max_steps, stopped, or failed (`raise_failure` says which)."""
        ...

    def raise_failure(self) -> None: ...

    async def poll(self) -> list[dict[str, Any]]:
        """The trainer's step rows since the last call."""
        ...

    async def stop_training(self) -> None:
        """Stop the trainer this deployment started (none for a remote one), so that the final
        evaluation sees one fixed policy."""
        ...

    async def record_eval(self, step: int, version: int, row: dict[str, Any]) -> None:
        """Show an evaluation row on the web page (as a step of the evaluation run)."""
        ...

    async def close(self) -> None: ...


def _state(out: Path) -> dict[str, Any]:
    p = out / STATE_FILE
    loaded: dict[str, Any] = json.loads(p.read_text()) if p.is_file() else {}
    return loaded


def _store_url(out: Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{(out / 'store.db').resolve()}"


def _save_state(out: Path, state: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    tmp.replace(out / STATE_FILE)


class LocalDeployment:
    def __init__(self) -> None:
        self.client: GatewayClient = None  # type: ignore[assignment]  # set by start()
        self.run_id = ""
        self.eval_run_id = ""
        self.served_model_name = ""
        self._rows: list[dict[str, Any]] = []
        self._step = 0
        self._c: Any = None
        self._server: Any = None
        self._serving: asyncio.Task[None] | None = None
        self._trainer: Any = None
        self._max_steps = 0

    @classmethod
    async def start(
        cls,
        cfg: TrainConfig,
        *,
        name: str,
        model_dir: Path,
        out: Path,
        served_model_name: str,
        engine: dict[str, Any] | None = None,
    ) -> LocalDeployment:
        """`cfg` without `run` and the store: they are this deployment's. `engine`: gateway
        settings of its local engine (`EngineSpec.settings`)."""
        import uvicorn

        from gateway.app import load_components
        from gateway.serving import EmbeddedServer
        from gateway.settings import GatewaySettings
        from rlgateway.app import create_app
        from rlgateway.embedded import EmbeddedTrainer

        self = cls()
        database_url = _store_url(out)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        settings = GatewaySettings(
            database_url=database_url,
            admin_token=f"rlg-admin-{secrets.token_urlsafe(12)}",
            model=str(model_dir),
            host="127.0.0.1",
            port=sock.getsockname()[1],
            served_model_name=served_model_name,
            **(engine or {}),
        )
        assert settings.admin_token is not None
        self.served_model_name = served_model_name
        self._c = c = await load_components(settings)
        try:
            state = _state(out)
            stored = cfg.model_dump(mode="json", exclude={"run", "database_url"})
            if "run_id" not in state:
                state["run_id"] = (await c.store.create_run(name, stored)).id
                state["eval_run_id"] = (await c.store.create_run(f"{name} (eval)", {})).id
                _save_state(out, state)
            self.run_id, self.eval_run_id = state["run_id"], state["eval_run_id"]
            self._server = EmbeddedServer(
                uvicorn.Config(
                    create_app(settings, components=c),
                    log_level="warning",
                    lifespan="on",
                    timeout_keep_alive=30,
                )
            )
            self._serving = asyncio.create_task(self._server.serve(sockets=[sock]))
            while not self._server.started:
                if self._serving.done():
                    await self._serving
                    raise RuntimeError("the gateway stopped while starting")
                await asyncio.sleep(0.05)
            self.client = GatewayClient(settings.base_url(), settings.admin_token)
            run_cfg = cfg.model_copy(update={"run": self.run_id, "database_url": database_url})
            self._max_steps = run_cfg.max_steps
            self._trainer = await EmbeddedTrainer.start(
                run_cfg, c, settings, report=self._rows.append
            )
            self._step = self._trainer.trainer.step
        except BaseException:
            await self.close()
            raise
        return self

    def trained_step(self) -> int:
        return self._step if self._trainer is None else int(self._trainer.trainer.step)

    def training_over(self) -> bool:
        return self._trainer is None or self._trainer.task.done()

    def raise_failure(self) -> None:
        t = self._trainer
        if t is not None and t.task.done() and not t.task.cancelled():
            t.task.result()

    async def poll(self) -> list[dict[str, Any]]:
        rows, self._rows[:] = list(self._rows), []
        return rows

    async def stop_training(self) -> None:
        if self._trainer is not None:
            await self._trainer.stop()
            self._step = int(self._trainer.trainer.step)
            self._trainer = None

    async def record_eval(self, step: int, version: int, row: dict[str, Any]) -> None:
        await self._c.store.record_step(
            self.eval_run_id, step, version=version, metrics=row, checkpoint=None
        )

    async def close(self) -> None:
        await self.stop_training()
        if self.client is not None:
            await self.client.close()
        if self._server is not None and self._serving is not None:
            self._server.should_exit = True
            await self._serving
            self._server = None
        if self._c is not None:
            await self._c.engine.close()
            await self._c.store.close()
            self._c = None


class RemoteDeployment:
    def __init__(self, client: GatewayClient, run_id: str, eval_run_id: str, max_steps: int):
        self.client = client
        self.run_id = run_id
        self.eval_run_id = eval_run_id
        self.served_model_name = ""
        self._max_steps = max_steps
        self._step = 0

    @classmethod
    async def start(
        cls,
        url: str,
        admin_token: str,
        cfg: TrainConfig,
        *,
        name: str,
        out: Path,
        run_id: str | None,
        served_model_name: str,
    ) -> RemoteDeployment:
        client = GatewayClient(url, admin_token)
        try:
            state = _state(out)
            if run_id is not None and state.get("run_id") != run_id:
                state = {"url": url, "run_id": run_id}  # another run: its own eval run too
            if state.get("url") not in (None, url) or "run_id" not in state:
                stored = cfg.model_dump(mode="json", exclude={"run", "database_url"})
                state = {"url": url, "run_id": await client.create_run(name, stored)}
            if "eval_run_id" not in state:
                state["eval_run_id"] = await client.create_run(f"{name} (eval)", {})
            _save_state(out, state)
            self = cls(client, state["run_id"], state["eval_run_id"], cfg.max_steps)
            self.served_model_name = served_model_name
            rows = await client.metrics(self.run_id)
            self._step = max((int(r["step"]) for r in rows), default=0)
        except BaseException:
            await client.close()
            raise
        print(
            f"run {self.run_id} on {url}: its trainer trains it "
            f"(e.g. rlgateway train --gateway-url {url} run={self.run_id} ...)",
            flush=True,
        )
        return self

    def trained_step(self) -> int:
        return self._step

    def training_over(self) -> bool:
        return self._step >= self._max_steps

    def raise_failure(self) -> None:
        return None

    async def poll(self) -> list[dict[str, Any]]:
        rows = await self.client.metrics(self.run_id, after=self._step)
        if rows:
            self._step = max(int(r["step"]) for r in rows)
        return rows

    async def stop_training(self) -> None:
        return None  # the deployment's trainer is not ours to stop

    async def record_eval(self, step: int, version: int, row: dict[str, Any]) -> None:
        return None  # the page shows the evaluation run's sessions; its curve is local

    async def close(self) -> None:
        await self.client.close()


ReportFn = Callable[[dict[str, Any]], None]
