"""The deployment tests' helpers: a run config on disk, agents driving a real gateway until the
trainer reaches a step, a separate `rlgateway train` process, and reads of its store."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.support.gateway_server import GatewayHandle

STEPS = 2


def drive(gw: GatewayHandle, run_id: str, until: int, timeout: float = 180) -> None:
    """Run GRPO groups of 2 (chat, reward, end) until the gateway serves version `until`. The
    rewards differ within every group by construction (the second session's is 1 higher, the
    text's share of lowercase letters adds at most 0.5), so each group's advantages are
    non-zero and every step moves the weights."""
    deadline = time.monotonic() + timeout
    g = 0
    while gw.client.get("/admin/version").json()["version"] < until:
        assert time.monotonic() < deadline, gw.log_tail()
        r = gw.client.post(f"/runs/{run_id}/sessions", json={"count": 2, "group_id": f"g{g}"})
        if r.status_code == 429:  # at the staleness bound: wait for the next version
            time.sleep(0.1)
            continue
        assert r.status_code == 201, r.text
        g += 1
        for i, s in enumerate(r.json()["sessions"]):
            key = {"Authorization": f"Bearer {s['api_key']}"}
            with httpx.Client(base_url=gw.url, headers=key, timeout=60) as agent:
                c = agent.post(
                    f"/sessions/{s['id']}/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
                )
                assert c.status_code == 200, c.text
                text = c.json()["choices"][0]["message"]["content"] or ""
                reward = i + sum(ch.islower() for ch in text) / (2 * max(len(text), 1))
                agent.post(f"/sessions/{s['id']}/reward", json={"reward": reward})
                agent.post(f"/sessions/{s['id']}/end")


def run_config(tmp_path: Path, **kw: Any) -> Path:
    path = tmp_path / "run.yaml"
    data = {
        "batch_size": 4,
        "group_size": 2,
        "eta": 1,
        "max_steps": STEPS,
        "checkpoint_dir": str(tmp_path / "ckpt"),
        "tensorboard": False,
        "optim": {"lr": 1e-3},
        **kw,
    }
    path.write_text(yaml.safe_dump(data))
    return path


@contextlib.contextmanager
def trainer(
    config: Path, log: Path, gateway_url: str | None = None, *overrides: str
) -> Iterator[subprocess.Popen[bytes]]:
    """`rlgateway train --config CONFIG` (publishing to `gateway_url`), output into `log`;
    killed on exit if it still runs."""
    cmd = [sys.executable, "-m", "rlgateway.cli", "train", "--config", str(config), *overrides]
    if gateway_url is not None:
        cmd += ["--gateway-url", gateway_url, "--admin-token", "test-admin"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def wait_until(done: Callable[[], bool], what: str, logs: list[Path], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            tails = "\n".join(f"{p}:\n{p.read_text(errors='replace')[-3000:]}" for p in logs)
            raise AssertionError(f"{what}: not within {timeout:.0f} s\n{tails}")
        time.sleep(0.1)


def db_path(gw: GatewayHandle) -> Path:
    return Path(gw.database_url.removeprefix("sqlite:///"))


def query(db: Path, sql: str, *args: Any) -> list[Any]:
    with sqlite3.connect(db) as conn:
        return conn.execute(sql, args).fetchall()


def last_step(db: Path, run_id: str) -> int:
    [(step,)] = query(db, "SELECT max(step) FROM train_steps WHERE run_id = ?", run_id)
    return int(step or 0)
