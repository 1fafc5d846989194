"""Completions/s the trajectory store commits, on SQLite and PostgreSQL, 1 and 16 writers, with
group commit (the default: concurrent calls share a transaction, `store.group_commit`) and
without it (each call its own transaction), side by side.

Each writer plays agent sessions of `--turns` turns: every turn is one `record_completions` call
(as the gateway makes it) holding a ~200-token prompt delta and 512 sampled tokens with their
logprobs and versions (drawn from a pool made before the clock starts). Writers run as
concurrent asyncio tasks on one `Store`, as the gateway's request handlers do. A call returns
once its transaction committed, either way. SQLite is a fresh file in a temp dir; PostgreSQL a
fresh database on the server at --postgres-url, dropped afterwards. Each row also prints the CPU
per completion of this process (the writers and the store's client side) and, for a PostgreSQL
server on this machine, of the server's processes (read from /proc; anything else the server
does meanwhile counts too, so measure on a quiet machine). Run from the repository root:

    .venv/bin/python bench/bench_store.py --concurrency 1 16
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import os
import platform
import random
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
from sqlalchemy.engine import make_url

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from store import Store  # noqa: E402
from store.types import CompletionRecord  # noqa: E402

_POOL_RNG = random.Random(0)
ID_POOL = [_POOL_RNG.randrange(50_000) for _ in range(1 << 16)]
"""Token ids the writers take slices of, made before any clock starts."""
LOGPROB_POOL = [-_POOL_RNG.random() for _ in range(1 << 12)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--completions", type=int, default=480, help="per measurement (default 480)")
    p.add_argument("--turns", type=int, default=8, help="turns per session (default 8)")
    p.add_argument("--output-tokens", type=int, default=512)
    p.add_argument("--delta-tokens", type=int, default=200, help="prompt delta per turn")
    p.add_argument("--backends", nargs="+", default=["sqlite", "postgres"])
    p.add_argument("--commit", nargs="+", default=["per-call", "grouped"])
    p.add_argument(
        "--postgres-url",
        default=os.environ.get(
            "RLGATEWAY_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
        ),
        help="a server where this user may CREATE DATABASE",
    )
    return p.parse_args(argv)


@contextlib.asynccontextmanager
async def database(backend: str, postgres_url: str) -> AsyncIterator[str]:
    if backend == "sqlite":
        with tempfile.TemporaryDirectory() as tmp:
            yield f"sqlite:///{tmp}/bench.db"
        return
    server = make_url(postgres_url).set(drivername="postgresql")
    name = f"rlg_bench_{secrets.token_hex(4)}"
    admin = await asyncpg.connect(server.render_as_string(hide_password=False))
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        yield server.set(database=name).render_as_string(hide_password=False)
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


async def writer(
    store: Store, run_id: str, count: int, args: argparse.Namespace, latencies: list[float]
) -> None:
    rng = random.Random(count)
    n_out, n_delta = args.output_tokens, args.delta_tokens
    done = 0

    def ids(n: int) -> list[int]:
        start = rng.randrange(len(ID_POOL) - n)
        return ID_POOL[start : start + n]

    while done < count:
        (new,) = await store.create_sessions(run_id, 1)
        sid, tokens = new.info.id, list[int]()
        for turn in range(min(args.turns, count - done)):
            delta, output = ids(n_delta), ids(n_out)
            record = CompletionRecord(
                id=f"chatcmpl-{secrets.token_hex(12)}",
                session_id=sid,
                segment_id=f"seg-{sid}",
                segment_index=0,
                opens_segment=turn == 0,
                prefix_break=False,
                transcript={"messages": [{"role": "user", "content": "x" * 200}] * (turn + 1)},
                prefix_len=len(tokens),
                prompt_ids=tokens + delta,
                output_ids=output,
                logprobs=LOGPROB_POOL[:n_out],
                versions=[3] * n_out,
                finish_reason="length",
            )
            t0 = time.perf_counter()
            await store.record_completions([record])
            latencies.append(time.perf_counter() - t0)
            tokens = tokens + delta + output
            done += 1
        await store.end_session(sid)


@dataclasses.dataclass
class Measured:
    rate: float
    latencies: list[float]
    client_ms: float
    """CPU of this process per completion (the writers and the store's client side)."""
    server_ms: float | None
    """CPU of the PostgreSQL server's processes per completion (None: SQLite, or a server this
    machine's /proc does not show)."""


async def measure(url: str, concurrency: int, grouped: bool, args: argparse.Namespace) -> Measured:
    store = await Store.connect(url, group_commit=grouped)
    try:
        run = await store.create_run("bench", {})
        await writer(store, run.id, 2 * concurrency, args, [])  # warm-up: pool, caches
        per = args.completions // concurrency
        latencies: list[float] = []
        cpu0, server0 = time.process_time(), _postgres_cpu_s(url)
        t0 = time.perf_counter()
        await asyncio.gather(
            *(writer(store, run.id, per, args, latencies) for _ in range(concurrency))
        )
        elapsed = time.perf_counter() - t0
        cpu1, server1 = time.process_time(), _postgres_cpu_s(url)
    finally:
        await store.close()
    n = per * concurrency
    server = None if server0 is None or server1 is None else 1000 * (server1 - server0) / n
    return Measured(n / elapsed, latencies, 1000 * (cpu1 - cpu0) / n, server)


def _postgres_cpu_s(url: str) -> float | None:
    """CPU seconds of every PostgreSQL process on this machine (those that exited counted in
    their parent's children's time); None for SQLite or when /proc shows none."""
    if url.startswith("sqlite"):
        return None
    ticks, found = 0, False
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if not (entry / "comm").read_text().startswith(("postgres", "postmaster")):
                continue
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        found = True
        ticks += sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
    return ticks / os.sysconf("SC_CLK_TCK") if found else None


async def amain(args: argparse.Namespace) -> None:
    print(
        "| backend | writers | commit | completions/s | p50 ms | p95 ms | grouped / per-call "
        "| client CPU ms/c | server CPU ms/c |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for backend in args.backends:
        for c in args.concurrency:
            rates: dict[str, float] = {}
            for mode in args.commit:
                async with database(backend, args.postgres_url) as url:
                    m = await measure(url, c, mode == "grouped", args)
                rates[mode] = m.rate
                lat_ms = sorted(1000 * x for x in m.latencies)
                p50 = statistics.median(lat_ms)
                p95 = lat_ms[int(0.95 * (len(lat_ms) - 1))]
                ratio = (
                    f"{rates['grouped'] / rates['per-call']:.2f}x"
                    if mode == "grouped" and "per-call" in rates
                    else ""
                )
                server = "" if m.server_ms is None else f"{m.server_ms:.3f}"
                print(
                    f"| {backend} | {c} | {mode} | {rates[mode]:,.0f} | {p50:.1f} | {p95:.1f} "
                    f"| {ratio} | {m.client_ms:.3f} | {server} |",
                    flush=True,
                )
    print()
    print(
        f"Each completion: one call with a {args.delta_tokens}-token prompt delta and "
        f"{args.output_tokens} output tokens (ids, logprobs, versions: "
        f"{4 * (args.delta_tokens + 3 * args.output_tokens):,} bytes of arrays), "
        f"{args.turns} turns per session, {args.completions} completions per row."
    )
    print(
        f"machine: {_cpu_model()}, {len(os.sched_getaffinity(0))} usable cores; python "
        f"{platform.python_version()}; {datetime.date.today().isoformat()}"
    )


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


if __name__ == "__main__":
    asyncio.run(amain(parse_args()))
