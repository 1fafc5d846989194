"""Reliability in one go: the fuzz run, a load run, and the fault runs, against real servers.

    .venv/bin/python bench/bench_reliability.py [--sessions 200 --turns 10 --fuzz-examples 80] \
        [--model tiny|smollm2|DIR]

The load and fault runs serve `--model` (the tiny test model by default); the fuzz run is the
test suite's own (the tiny model).

1. **fuzz**: the property-based suite (`tests/integration/gateway/test_fuzz_api.py`: every
   operation of the OpenAPI document, schema-conforming and not) against a real `rlgateway
   serve`; how many cases, how many failed.
2. **load**: `--sessions` sessions x `--turns` multi-turn chat turns (each turn extends the
   conversation with the reply it got), `--concurrency` at a time; every acknowledged turn must
   be in the store in its session's one segment: lost and prefix breaks are counted.
3. **engine kill**: the load again, and `kill -9` of the engine process half-way: the 503s the
   clients got, how long `/health` was 503, and whether every session then finished its turns
   (acknowledged turns lost, prefix breaks).
4. **gateway kill**: `kill -9` of `rlgateway serve` half-way, a restart on the same database,
   and the same counts.

Prints one table. Nothing here is asserted by a test; the tests assert the guarantees.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
ADMIN = "bench-admin"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):
            kids += [int(k) for k in (task / "children").read_text().split()]
    return kids


@dataclass
class Server:
    port: int
    database_url: str
    log: Path
    model: str | None = None
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        cmd = [
            sys.executable,
            *("-m", "rlgateway.cli", "serve", "--port", str(self.port)),
            *("--database-url", self.database_url, "--admin-token", ADMIN),
            *(("--model", self.model) if self.model else ()),
            *("--log-level", "warning"),
        ]
        env = {**os.environ, "RLGATEWAY_MAX_MODEL_LEN": "1024", "HF_HUB_OFFLINE": "1"}
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError("serve did not come up")

    def engine_pid(self) -> int:
        assert self.proc is not None
        (pid,) = [
            p
            for p in _children(self.proc.pid)
            if b"engines.process_main" in Path(f"/proc/{p}/cmdline").read_bytes()
        ]
        return pid

    def kill(self) -> None:
        assert self.proc is not None
        kids = _children(self.proc.pid)
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        for pid in kids:  # the engine process exits with its gateway; make sure of it
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@dataclass
class Load:
    """Sessions that each hold a conversation of `turns` turns; what the clients saw."""

    sessions: list[dict[str, Any]]
    turns: int
    acked: dict[str, list[str]] = field(default_factory=dict)
    """Per session, the completion ids its client received, in order."""
    history: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    errors: dict[int, int] = field(default_factory=dict)
    """Statuses other than 200 the clients got (transport errors as 0), with their counts."""
    latencies: list[float] = field(default_factory=list)
    """Seconds from a turn's first attempt to its answer, per acknowledged turn."""

    def done(self) -> int:
        return sum(len(v) for v in self.acked.values())

    async def run(self, concurrency: int, *, retry: bool, target: str | None = None) -> None:
        """Every session's remaining turns; with `retry`, a refused or failed turn is sent again
        (after its Retry-After) until it is answered: what an agent riding out a fault does.
        `target`: the gateway's URL, in place of the one in the sessions' `base_url`."""
        gate = asyncio.Semaphore(concurrency)
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(timeout=300, limits=limits) as http:

            async def one(s: dict[str, Any]) -> None:
                sid = s["id"]
                base = f"{target}/sessions/{sid}/v1" if target else s["base_url"]
                hist = self.history.setdefault(sid, [])
                acked = self.acked.setdefault(sid, [])
                attempt = 0
                started = time.perf_counter()
                while len(acked) < self.turns:
                    messages = [*hist, {"role": "user", "content": f"turn {len(acked)}"}]
                    # the header the openai SDK sends: a retry may take an unseen turn's place
                    headers = {
                        "Authorization": f"Bearer {s['api_key']}",
                        "x-stainless-retry-count": str(attempt),
                    }
                    async with gate:
                        try:
                            r = await http.post(
                                f"{base}/chat/completions",
                                headers=headers,
                                json={"messages": messages, "max_tokens": 8, "seed": 1},
                            )
                            status = r.status_code
                        except httpx.TransportError:
                            status = 0
                    if status == 200:
                        body = r.json()
                        acked.append(body["id"])
                        hist[:] = [*messages, body["choices"][0]["message"]]
                        attempt = 0
                        self.latencies.append(time.perf_counter() - started)
                        started = time.perf_counter()
                        continue
                    attempt += 1
                    self.errors[status] = self.errors.get(status, 0) + 1
                    if not retry:
                        return
                    wait = r.headers.get("Retry-After", "1") if status else "1"
                    await asyncio.sleep(min(float(wait), 2.0))

            await asyncio.gather(*(one(s) for s in self.sessions))


def check(server: Server, load: Load) -> dict[str, int]:
    """Acknowledged turns missing from their session's recording, and prefix breaks."""
    lost = breaks = 0
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {ADMIN}"}) as c:
        for s in load.sessions:
            detail = c.get(f"/sessions/{s['id']}", timeout=60).json()
            recorded = [cid for seg in detail["segments"] for cid in seg["completion_ids"]]
            lost += sum(1 for cid in load.acked.get(s["id"], []) if cid not in recorded)
            breaks += detail["prefix_breaks"]
    return {"lost": lost, "prefix_breaks": breaks}


def new_load(server: Server, sessions: int, turns: int) -> Load:
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {ADMIN}"}) as c:
        run = c.post("/runs", json={"name": "reliability"}).json()["id"]
        made: list[dict[str, Any]] = []
        while len(made) < sessions:
            n = min(100, sessions - len(made))
            r = c.post(f"/runs/{run}/sessions", json={"count": n})
            made += r.json()["sessions"]
    return Load(made, turns)


def fuzz(examples: int) -> dict[str, Any]:
    env = {**os.environ, "RLGATEWAY_FUZZ_EXAMPLES": str(examples)}
    t0 = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
         "tests/integration/gateway/test_fuzz_api.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    cases = re.search(r'\{"fuzz_cases": (\d+)\}', done.stdout)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-300:]
    return {
        "cases": int(cases.group(1)) if cases else 0,
        "result": summary,
        "seconds": time.perf_counter() - t0,
    }


async def _kill_midway(load: Load, concurrency: int, kill: Any, total: int) -> None:
    work = asyncio.create_task(load.run(concurrency, retry=True))
    while sum(len(v) for v in load.acked.values()) < total // 2:
        await asyncio.sleep(0.05)
    await asyncio.to_thread(kill)
    await work


def _health_down_seconds(server: Server, stop: list[bool]) -> float:
    """Seconds /health answered anything but 200 until `stop[0]` (polled every 50 ms)."""
    down = 0.0
    while not stop[0]:
        t = time.perf_counter()
        try:
            ok = httpx.get(f"{server.url}/health", timeout=2).status_code == 200
        except httpx.TransportError:
            ok = False
        time.sleep(0.05)
        if not ok:
            down += time.perf_counter() - t
    return down


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sessions", type=int, default=200)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--fuzz-examples", type=int, default=80)
    ap.add_argument("--model", default="tiny", help="tiny (the test model), smollm2 or a directory")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-rel-"))
    total = args.sessions * args.turns
    rows: list[tuple[str, str]] = []

    f = fuzz(args.fuzz_examples)
    rows.append(("fuzz", f"{f['cases']} cases, {f['result']} ({f['seconds']:.0f} s)"))

    from rlgateway.models import resolve_model

    model = str(resolve_model(args.model, Path.cwd()))
    server = Server(_free_port(), f"sqlite:///{tmp / 'load.db'}", tmp / "load.log", model)
    server.start()
    try:
        load = new_load(server, args.sessions, args.turns)
        t0 = time.perf_counter()
        asyncio.run(load.run(args.concurrency, retry=False))
        took = time.perf_counter() - t0
        acked = sum(len(v) for v in load.acked.values())
        c = check(server, load)
        rows.append((
            "load",
            f"{args.sessions} sessions x {args.turns} turns: {acked} acknowledged in {took:.0f} s, "
            f"errors {load.errors or 0}, lost {c['lost']}, prefix breaks {c['prefix_breaks']}",
        ))  # fmt: skip

        load = new_load(server, args.sessions, args.turns)
        stop = [False]
        box: dict[str, float] = {}
        watcher = threading.Thread(
            target=lambda: box.__setitem__("down", _health_down_seconds(server, stop))
        )
        watcher.start()
        pid = server.engine_pid()
        asyncio.run(
            _kill_midway(load, args.concurrency, lambda: os.kill(pid, signal.SIGKILL), total)
        )
        stop[0] = True
        watcher.join()
        c = check(server, load)
        health = httpx.get(f"{server.url}/health", timeout=10).json()
        rows.append((
            "engine kill -9",
            f"clients got {load.errors}; /health not 200 for {box['down']:.1f} s; engine restarts "
            f"{health['restarts']}; afterwards {sum(len(v) for v in load.acked.values())}/{total} "
            f"turns acknowledged, lost {c['lost']}, prefix breaks {c['prefix_breaks']}",
        ))  # fmt: skip
    finally:
        server.stop()

    server = Server(_free_port(), f"sqlite:///{tmp / 'kill.db'}", tmp / "kill.log", model)
    server.start()
    try:
        load = new_load(server, args.sessions, args.turns)

        def kill_and_restart() -> None:
            server.kill()
            t = time.perf_counter()
            server.start()
            box["restart"] = time.perf_counter() - t

        asyncio.run(_kill_midway(load, args.concurrency, kill_and_restart, total))
        c = check(server, load)
        rows.append((
            "gateway kill -9",
            f"clients got {load.errors}; back in {box['restart']:.1f} s on the same database; "
            f"{sum(len(v) for v in load.acked.values())}/{total} turns acknowledged, "
            f"lost {c['lost']}, prefix breaks {c['prefix_breaks']}",
        ))  # fmt: skip
    finally:
        server.stop()

    width = max(len(k) for k, _ in rows)
    print(f"\n| {'run':<{width}} | result |\n|{'-' * (width + 2)}|---|")
    for k, v in rows:
        print(f"| {k:<{width}} | {v} |")
    print(json.dumps({"logs": str(tmp)}))


if __name__ == "__main__":
    main()
