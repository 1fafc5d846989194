"""The RL loop tests' harness (tests/integration/trainer/): the gateway in this process on the
local engine (in this process or its own) and SQLite, the toy task's grader, a run's train config,
trajectories recorded through a real `rlgateway serve`, and what each step consumed."""

from __future__ import annotations

import asyncio
import sqlite3
from collections import defaultdict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from engines.local import LocalEngine, LocalEngineConfig
from engines.process import ProcessEngine
from gateway.settings import GatewaySettings
from rlgateway.app import create_app
from store import Store
from tests.support.components import tiny_components
from trainer.config import TrainConfig

ADMIN = {"Authorization": "Bearer admin"}
PROMPT = [{"role": "user", "content": "write lowercase letters"}]
MAX_TOKENS = 16
ADMISSION_WAIT_S = 300.0


def grade(text: str) -> float:
    """The toy task: as many lowercase ASCII letters as possible in MAX_TOKENS tokens."""
    return sum("a" <= c <= "z" for c in text) / MAX_TOKENS


@dataclass
class Harness:
    http: httpx.AsyncClient
    engine: LocalEngine | ProcessEngine
    store: Store
    db_path: Path
    rejected: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    """More fields of every episode's request (e.g. a `response_format`)."""

    async def run(self, config: dict[str, Any]) -> str:
        r = await self.http.post("/runs", json={"name": "t", "config": config}, headers=ADMIN)
        assert r.status_code == 201, r.text
        run_id: str = r.json()["id"]
        return run_id

    async def group(self, run_id: str, size: int, gid: str) -> list[dict[str, Any]]:
        """Create a GRPO group, waiting while the gateway's admission says 429 (at most
        `ADMISSION_WAIT_S`: a run whose admission never frees fails the test, not hangs it)."""
        deadline = asyncio.get_running_loop().time() + ADMISSION_WAIT_S
        while True:
            r = await self.http.post(
                f"/runs/{run_id}/sessions", json={"count": size, "group_id": gid}, headers=ADMIN
            )
            if r.status_code == 429:
                assert r.headers["retry-after"]
                waited = f"429 for {ADMISSION_WAIT_S:.0f} s: {r.text}"
                assert asyncio.get_running_loop().time() < deadline, waited
                self.rejected += 1
                await asyncio.sleep(0.02)
                continue
            assert r.status_code == 201, r.text
            sessions: list[dict[str, Any]] = r.json()["sessions"]
            return sessions

    async def episode(self, s: dict[str, Any]) -> None:
        key = {"Authorization": f"Bearer {s['api_key']}"}
        r = await self.http.post(
            f"/sessions/{s['id']}/v1/chat/completions",
            json={"messages": PROMPT, "max_tokens": MAX_TOKENS, **self.extra},
            headers=key,
        )
        assert r.status_code == 200, r.text
        reward = grade(r.json()["choices"][0]["message"]["content"] or "")
        await self.http.post(f"/sessions/{s['id']}/reward", json={"reward": reward}, headers=key)
        await self.http.post(f"/sessions/{s['id']}/end", headers=key)

    async def agents(
        self, run_id: str, group_size: int, until_version: int, concurrency: int = 4
    ) -> None:
        """`concurrency` agent loops, each running one GRPO group after another."""

        async def loop(a: int) -> None:
            g = 0
            while self.engine.version() < until_version:
                sessions = await self.group(run_id, group_size, f"a{a}-g{g}")
                g += 1
                await asyncio.gather(*(self.episode(s) for s in sessions))

        await asyncio.gather(*(loop(a) for a in range(concurrency)))

    def consumed(self) -> dict[str, int]:
        with sqlite3.connect(self.db_path) as db:
            rows = db.execute("SELECT id, consumed_step FROM sessions WHERE train_state='consumed'")
            return {sid: step for sid, step in rows}


@asynccontextmanager
async def harness(
    tiny_model: Path, tmp_path: Path, engine_kind: str = "local"
) -> AsyncIterator[Harness]:
    """The gateway in this process on the local engine, in this process or in its own."""
    config = LocalEngineConfig(model=str(tiny_model))
    engine: LocalEngine | ProcessEngine = (
        LocalEngine.load(config) if engine_kind == "local" else ProcessEngine.load(config)
    )
    db_path = tmp_path / "store.db"
    store = await Store.connect(f"sqlite:///{db_path}")
    components = tiny_components(engine, store, tiny_model)
    app = create_app(GatewaySettings(admin_token="admin"), components)
    try:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(
                transport=transport, base_url="http://gw", timeout=120
            ) as http:
                yield Harness(http, engine, store, db_path)
    finally:
        await engine.close()
        await store.close()


def train_config(run_id: str, tmp_path: Path, **kw: Any) -> TrainConfig:
    return TrainConfig.model_validate(
        {
            "run": run_id,
            "database_url": "sqlite:///unused",
            "checkpoint_dir": str(tmp_path / "ckpt"),
            "tensorboard": False,
            "max_tokens": MAX_TOKENS,
            **kw,
        }
    )


def record_trajectories(tiny_model: Path, tmp_path: Path, count: int) -> str:
    """`count` ended, rewarded single-turn sessions (groups of 2) in tmp_path/store.db."""

    async def record() -> str:
        async with harness(tiny_model, tmp_path) as h:
            run_id = await h.run({})  # no staleness config: the gateway does not throttle
            for g in range(count // 2):
                sessions = await h.group(run_id, 2, f"g{g}")
                await asyncio.gather(*(h.episode(s) for s in sessions))
            return run_id

    return asyncio.run(record())


def write_run_config(tmp_path: Path, tiny_model: Path, run_id: str, **kw: Any) -> Path:
    import yaml

    config = tmp_path / "run.yaml"
    data = {
        "run": run_id,
        "database_url": f"sqlite:///{tmp_path / 'store.db'}",
        "model": str(tiny_model),
        "group_size": 2,
        "checkpoint_dir": str(tmp_path / "ckpt"),
        "lease_seconds": 3,
        "tensorboard": False,
        "optim": {"lr": 1e-3},
        **kw,
    }
    config.write_text(yaml.safe_dump(data))
    return config


def consumed_per_step(db_path: Path) -> dict[int | None, int]:
    with sqlite3.connect(db_path) as db:
        rows = list(db.execute("SELECT train_state, consumed_step FROM sessions"))
    per_step: dict[int | None, int] = defaultdict(int)
    for state, step in rows:
        per_step[step if state == "consumed" else None] += 1
    return dict(per_step)
