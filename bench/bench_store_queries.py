"""The store's read paths and its hot path on a long run's history: how long the trainer's
claim, staleness admission, the idle sweep and the admin browser take on PostgreSQL when a run
holds many settled sessions, and an agent's session made, its turns recorded and the session
ended beside them, with the plan PostgreSQL picks for each of their statements.

A fresh database gets one run of `--sessions` sessions (groups of 8; 4 turns of 64 sampled tokens
each, a reward each), nearly all of them trained long ago, `--queue` ended and waiting for the
trainer, and as many still active: a run late in its life, written with `INSERT ... SELECT` from
`generate_series` (fast to build, the same rows the store writes). Each store call then runs
`--repeat` times (the median is reported), and every statement it issued is run again under
`EXPLAIN (ANALYZE, COSTS OFF)` and its plan printed (a write's plan under `EXPLAIN` alone; the hot
path's statements, sent through asyncpg itself, are read from asyncpg's query log). Run
from the repository root:

    .venv/bin/python bench/bench_store_queries.py [--sessions 100000]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg
from sqlalchemy import event

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "bench"))

from bench_store import _cpu_model, database  # noqa: E402

from store import Store  # noqa: E402
from store.types import CompletionRecord, SessionFilter, SessionStatus  # noqa: E402

GROUP = 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sessions", type=int, default=100_000, help="settled sessions of the run")
    p.add_argument("--queue", type=int, default=64, help="ended sessions waiting to be trained")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--plans", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--postgres-url",
        default=os.environ.get(
            "RLGATEWAY_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
        ),
    )
    return p.parse_args(argv)


FILL = """
INSERT INTO sessions (id, run_id, group_id, metadata, key_hash, created_at, ended_at,
    prefix_breaks, turn_count, train_state, lease_owner, lease_expires_at, consumed_step,
    outcome, failure)
SELECT 'sess_' || lpad(i::text, 24, '0'), $1::text, 'g' || (i / {group}), '{{}}',
    md5(i::text) || md5((-i)::text), $2::timestamptz + i * interval '1 ms',
    CASE WHEN i >= $3::int + $4::int THEN NULL
        ELSE $2::timestamptz + i * interval '1 ms' + interval '1 s' END,
    0, 4,
    CASE WHEN i < $3::int THEN 'consumed' ELSE 'pending' END, NULL, NULL,
    CASE WHEN i < $3::int THEN 1 + i / 256 END,
    CASE WHEN i < $3::int THEN (CASE WHEN i % 50 = 0 THEN 'failed' ELSE 'trained' END) END,
    NULL
FROM generate_series(0, $3::int + 2 * $4::int - 1) AS i;

INSERT INTO segments (id, session_id, position, transcript, length, created_at)
SELECT 'seg_' || id, id, 0, '{{"messages": []}}', 4 * (16 + 64), created_at FROM sessions;

INSERT INTO completions (id, session_id, segment_id, turn, prefix_len, prompt_delta, output_ids,
    logprobs, versions, min_version, max_version, finish_reason, status, side, sampling, request,
    response, latency_ms, ttft_ms, created_at)
SELECT 'cmpl_' || s.id || '_' || t, s.id, 'seg_' || s.id, t, t * 80,
    decode(repeat('01000000', 16), 'hex'), decode(repeat('02000000', 64), 'hex'),
    decode(repeat('0000803f', 64), 'hex'), decode(repeat('03000000', 64), 'hex'), 3, 3,
    'stop', 'ok', NULL, '{{}}', '{{}}', '{{}}', 10.0, 1.0, s.created_at
FROM sessions s CROSS JOIN generate_series(0, 3) AS t;

INSERT INTO rewards (session_id, completion_id, key, value, created_at, late)
SELECT id, NULL, NULL, 1.0, created_at, false FROM sessions WHERE ended_at IS NOT NULL;
"""


async def fill(url: str, run_id: str, settled: int, queue: int) -> None:
    conn = await asyncpg.connect(url.replace("postgresql+asyncpg", "postgresql"))
    try:
        start = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=1)
        for statement in FILL.format(group=GROUP).split(";\n"):
            if statement.strip():
                args = (run_id, start, settled, queue)
                await conn.execute(statement, *args[: statement.count("$") and 4])
        await conn.execute("VACUUM ANALYZE")  # as autovacuum leaves a settled history
    finally:
        await conn.close()


async def timed(call: Callable[[], Awaitable[Any]], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        await call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


async def amain(args: argparse.Namespace) -> None:
    async with database("postgres", args.postgres_url) as url:
        store = await Store.connect(url)
        try:
            run = await store.create_run("history", {})
            t0 = time.perf_counter()
            await fill(store.url, run.id, args.sessions, args.queue)
            built = time.perf_counter() - t0
            seen: list[tuple[str, Any]] = []

            def capture(_c: Any, _cur: Any, stmt: str, params: Any, _ctx: Any, many: bool) -> None:
                if not many and stmt.lstrip().upper().startswith("SELECT"):
                    seen.append((stmt, params))

            for engine in store._db.sync_engines:
                event.listen(engine, "before_cursor_execute", capture)
            some = f"sess_{0:024d}"
            calls: dict[str, Callable[[], Awaitable[Any]]] = {
                "claim_groups (nothing ready)": lambda: store.claim_groups(
                    run.id, batch_size=10**6, group_size=GROUP, partial_groups="wait",
                    deadline_seconds=3600, owner="bench", lease_seconds=60,
                ),
                "run_counts (admission)": lambda: store.run_counts(run.id),
                "end_idle (nothing idle)": lambda: store.end_idle(run.id, idle_seconds=10**6),
                "outcome_counts": lambda: store.outcome_counts(run.id),
                "list_sessions (page 1)": lambda: store.list_sessions(run.id, SessionFilter()),
                "list_sessions (ended, rewarded >= 1)": lambda: store.list_sessions(
                    run.id, SessionFilter(status=SessionStatus.ENDED, min_reward=1.0)
                ),
                "list_sessions (one group)": lambda: store.list_sessions(
                    run.id, SessionFilter(group_id="g7")
                ),
                "session_detail": lambda: store.session_detail(some),
            }  # fmt: skip
            print(
                f"{args.sessions:,} settled sessions, {args.queue} queued, {args.queue} active "
                f"(groups of {GROUP}, 4 turns each; built in {built:.0f} s)\n"
            )
            print("| store call | median ms |")
            print("|---|---:|")
            plans: dict[str, list[tuple[str, Any]]] = {}
            for name, call in calls.items():
                seen.clear()
                ms = 1000 * await timed(call, args.repeat)
                plans[name] = list(dict.fromkeys((s, tuple(p or ())) for s, p in seen))
                print(f"| {name} | {ms:,.1f} |", flush=True)
            await hot_path(store, run.id, args.repeat, plans)
            if args.plans:
                await explain(store.url, plans)
        finally:
            await store.close()
    print(
        f"\nmachine: {_cpu_model()}, {len(os.sched_getaffinity(0))} usable cores; python "
        f"{sys.version.split()[0]}; {datetime.date.today().isoformat()}"
    )


async def hot_path(
    store: Store, run_id: str, repeat: int, plans: dict[str, list[tuple[str, Any]]]
) -> None:
    """Time an agent's session made, its first and second turns recorded (512 sampled tokens
    each) and the session ended, `repeat` fresh sessions each, and keep each one's statements
    (sent through asyncpg itself: read from its query log) for `explain`."""
    seen: list[tuple[str, Any]] = []
    logged: list[Any] = []

    def on_query(query: Any) -> None:
        seen.append((query.query, tuple(query.args or ())))

    def on_checkout(dbapi_connection: Any, *_args: Any) -> None:
        driver = dbapi_connection.driver_connection
        if driver not in logged:
            driver.add_query_logger(on_query)
            logged.append(driver)

    sids: list[str] = []

    def turn(sid: str, index: int) -> CompletionRecord:
        prompt = list(range(100 + 612 * index))
        return CompletionRecord(
            id=f"{sid}-{index}", session_id=sid, segment_id=f"{sid}-seg", segment_index=0,
            opens_segment=index == 0, prefix_break=False, transcript={"messages": []},
            prefix_len=len(prompt) - 100 if index else 0, prompt_ids=prompt,
            output_ids=[7] * 512, logprobs=[-0.5] * 512, versions=[1] * 512,
            finish_reason="length",
        )  # fmt: skip

    async def made() -> None:
        sids.extend(s.info.id for s in await store.create_sessions(run_id, 1))

    def each(call: Callable[[str], Awaitable[Any]]) -> Callable[[], Awaitable[Any]]:
        """`call` on the sessions made, one after the other (they exist once `made` ran)."""
        done = iter(range(repeat))
        return lambda: call(sids[next(done)])

    pool = store._db.engine.sync_engine.pool
    event.listen(pool, "checkout", on_checkout)
    try:
        steps: list[tuple[str, Callable[[], Awaitable[Any]]]] = [
            ("create_sessions (one)", made),
            ("record_completions (a first turn)",
             each(lambda sid: store.record_completions([turn(sid, 0)]))),
            ("record_completions (a second turn)",
             each(lambda sid: store.record_completions([turn(sid, 1)]))),
            ("end_session", each(store.end_session)),
        ]  # fmt: skip
        for name, call in steps:
            seen.clear()
            ms = 1000 * await timed(call, repeat)
            await asyncio.sleep(0)  # the query log's callbacks run on the loop
            first: dict[str, Any] = {}
            for stmt, params in seen:
                first.setdefault(stmt, params)
            plans[name] = list(first.items())
            print(f"| {name} | {ms:,.1f} |", flush=True)
    finally:
        event.remove(pool, "checkout", on_checkout)
        for driver in logged:
            driver.remove_query_logger(on_query)


async def explain(url: str, plans: dict[str, list[tuple[str, Any]]]) -> None:
    conn = await asyncpg.connect(url.replace("postgresql+asyncpg", "postgresql"))
    try:
        for name, statements in plans.items():
            print(f"\n### {name}")
            for stmt, params in statements:
                if "set_config('jit'" in stmt or "typeinfo_tree" in stmt:
                    continue  # asyncpg's look-up of a statement's types
                print("    " + " ".join(stmt.split())[:160])
                writes = stmt.lstrip().upper().startswith(("INSERT", "UPDATE", "WITH"))
                # a write ran already (its ids are taken): its plan, not run again
                how = "EXPLAIN (COSTS OFF) " if writes else "EXPLAIN (ANALYZE, COSTS OFF) "
                rows = await conn.fetch(how + stmt, *params)
                for row in rows:
                    print("      " + row[0])
    finally:
        await conn.close()


if __name__ == "__main__":
    asyncio.run(amain(parse_args()))
