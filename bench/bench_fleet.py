"""A fleet under load: multi-turn sessions through HAProxy on two `rlgateway serve` replicas on one
PostgreSQL database, side by side with one replica alone, then the fleet with a replica SIGKILLed
half-way and started again.

    .venv/bin/python bench/bench_fleet.py [--sessions 1000 --turns 10 --concurrency 1000] \
        [--model tiny|smollm2|DIR]

Each session holds a conversation of `--turns` turns (each turn extends it with the reply it
got), all sessions at once up to `--concurrency`, on loopback, the tiny model (or `--model`),
each replica with its engine process. A refused or failed turn is sent again with the openai
SDK's retry header (`x-stainless-retry-count`), as an agent riding out a fault does. Afterwards
each session's recording is read back: "lost" counts turns a client got a 200 for that are not
in their session's segments, "unseen" counts turns in the segments (what the trainer trains)
that no client got, "breaks" the prefix breaks. Needs PostgreSQL (RLGATEWAY_TEST_POSTGRES_URL,
default the local server) and HAProxy (Debian's package). Prints one table; nothing here is
asserted by a test (tests/integration/deployment/test_fleet_faults.py asserts the guarantees).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Coroutine
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
from bench_reliability import Load  # this folder is first on sys.path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # for tests/support (the gateway process and HAProxy)

ADMIN = {"Authorization": "Bearer test-admin"}


def timed(work: Coroutine[Any, Any, None]) -> float:
    t0 = time.perf_counter()
    asyncio.run(work)
    return time.perf_counter() - t0


def new_load(admin: httpx.Client, sessions: int, turns: int) -> Load:
    run = admin.post("/runs", json={"name": "fleet-bench", "config": {}}).json()["id"]
    made: list[dict[str, Any]] = []
    while len(made) < sessions:
        r = admin.post(f"/runs/{run}/sessions", json={"count": min(500, sessions - len(made))})
        made += r.json()["sessions"]
    return Load(made, turns)


def check(admin: httpx.Client, load: Load) -> dict[str, int]:
    lost = unseen = breaks = 0
    for s in load.sessions:
        detail = admin.get(f"/sessions/{s['id']}", timeout=60).json()
        recorded = [cid for seg in detail["segments"] for cid in seg["completion_ids"]]
        acked = load.acked.get(s["id"], [])
        lost += sum(1 for cid in acked if cid not in recorded)
        unseen += sum(1 for cid in recorded if cid not in acked)
        breaks += detail["prefix_breaks"]
    return {"lost": lost, "unseen": unseen, "breaks": breaks}


def row(name: str, load: Load, seconds: float, counts: dict[str, int]) -> list[str]:
    lat = sorted(load.latencies)
    p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
    errors = ", ".join(f"{n} x {s or 'conn'}" for s, n in sorted(load.errors.items())) or "0"
    return [
        name,
        f"{load.done()}",
        f"{load.done() / seconds:.0f}",
        f"{statistics.median(lat) * 1000:.0f}",
        f"{p99 * 1000:.0f}",
        errors,
        str(counts["lost"]),
        str(counts["unseen"]),
        str(counts["breaks"]),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sessions", type=int, default=1000)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--concurrency", type=int, default=1000)
    ap.add_argument("--model", default="tiny", help="tiny (the test model), smollm2 or a directory")
    args = ap.parse_args()

    from rlgateway.models import resolve_model
    from tests.store_fixtures import create_postgres_database, drop_postgres_database
    from tests.support.gateway_server import free_port, run_gateway
    from tests.support.load_balancer import run_haproxy

    model = resolve_model(args.model, Path.cwd())
    tmp = Path(tempfile.mkdtemp(prefix="bench-fleet-"))
    database_url = create_postgres_database()
    lb_port, ports = free_port(), {"a": free_port(), "b": free_port()}
    env = {
        "RLGATEWAY_PUBLIC_URL": f"http://127.0.0.1:{lb_port}",
        "RLGATEWAY_MAX_MODEL_LEN": "1024",
        "OMP_NUM_THREADS": "1",
    }
    rows: list[list[str]] = []
    try:
        with ExitStack() as stack:

            def start(name: str) -> Any:
                logs = tmp / f"{name}-{time.monotonic_ns()}"
                logs.mkdir()
                return stack.enter_context(
                    run_gateway(
                        model,
                        logs,
                        port=ports[name],
                        database_url=database_url,
                        extra_env=env,
                        admin_token="test-admin",
                    )
                )

            replicas = {name: start(name) for name in ports}
            lb = stack.enter_context(run_haproxy(lb_port, ports, tmp))
            admin = stack.enter_context(httpx.Client(base_url=lb, headers=ADMIN, timeout=120))

            load = new_load(admin, args.sessions, args.turns)
            took = timed(load.run(args.concurrency, retry=True, target=replicas["a"].url))
            rows.append(row("one replica (a, direct)", load, took, check(admin, load)))

            load = new_load(admin, args.sessions, args.turns)
            took = timed(load.run(args.concurrency, retry=True))
            rows.append(row("two replicas behind HAProxy", load, took, check(admin, load)))

            load = new_load(admin, args.sessions, args.turns)
            restart: dict[str, float] = {}

            async def with_a_kill() -> None:
                work = asyncio.create_task(load.run(args.concurrency, retry=True))
                while load.done() < args.sessions * args.turns // 2:
                    await asyncio.sleep(0.05)
                os.killpg(replicas["b"].pid, signal.SIGKILL)
                t = time.perf_counter()
                replicas["b"] = await asyncio.to_thread(start, "b")
                restart["b"] = time.perf_counter() - t
                await work

            took = timed(with_a_kill())
            name = f"two, b kill -9 half-way (back in {restart['b']:.0f} s)"
            rows.append(row(name, load, took, check(admin, load)))
    finally:
        drop_postgres_database(database_url)

    head = ["run", "turns", "turns/s", "p50 ms", "p99 ms", "errors", "lost", "unseen", "breaks"]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |")
    print(f"logs: {tmp}")


if __name__ == "__main__":
    main()
