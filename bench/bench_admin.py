"""The admin side on a run of many recorded sessions: a page of the session browser (with and
without filters), the JSONL export's throughput, and deleting the run.

    .venv/bin/python bench/bench_admin.py [--sessions 2000] [--database-url URL]

Sessions are written straight into the store (two turns each: a 200-token prompt, 100 sampled
tokens, then 20 more prompt tokens and 100 more sampled), half of them rewarded, policy versions
spread over 0..9. Default store: a fresh SQLite file in a temporary directory.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path


async def fill(store: object, run_id: str, n: int) -> None:
    from store import Store
    from store.types import CompletionRecord

    assert isinstance(store, Store)
    sessions: list[str] = []
    while len(sessions) < n:
        more = await store.create_sessions(run_id, min(256, n - len(sessions)))
        sessions += [s.info.id for s in more]
    for i, sid in enumerate(sessions):
        v = i % 10
        prompt = list(range(200))
        out = [5] * 100
        second = [*prompt, *out, *range(20)]
        recs = [
            CompletionRecord(
                id=f"c{i}-0",
                session_id=sid,
                segment_id=f"{sid}-s0",
                segment_index=0,
                opens_segment=True,
                prefix_break=False,
                transcript={"messages": [{"role": "user", "content": "x" * 200}]},
                prefix_len=0,
                prompt_ids=prompt,
                output_ids=out,
                logprobs=[-0.5] * 100,
                versions=[v] * 100,
                finish_reason="stop",
            )
        ]
        await store.record_completions(recs)
        await store.record_completions(
            [
                CompletionRecord(
                    id=f"c{i}-1",
                    session_id=sid,
                    segment_id=f"{sid}-s0",
                    segment_index=0,
                    opens_segment=False,
                    prefix_break=False,
                    transcript={"messages": [{"role": "user", "content": "y" * 220}]},
                    prefix_len=300,
                    prompt_ids=second,
                    output_ids=out,
                    logprobs=[-0.25] * 100,
                    versions=[v] * 100,
                    finish_reason="stop",
                )
            ]
        )
        if i % 2 == 0:
            await store.add_reward(sid, (i % 7) / 7)
            await store.end_session(sid)


async def timed(fn: object, repeat: int) -> float:
    """Median milliseconds of `repeat` awaits of fn()."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        await fn()  # type: ignore[operator]
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


async def main(n: int, url: str) -> None:
    from gateway.export import jsonl
    from store import Store
    from store.types import SessionFilter, SessionStatus

    store = await Store.connect(url)
    try:
        run = await store.create_run("bench", {})
        t0 = time.perf_counter()
        await fill(store, run.id, n)
        print(f"recorded {n} sessions in {time.perf_counter() - t0:.1f} s ({store.dialect})\n")
        cases = {
            "newest 50, no filter": SessionFilter(),
            "status=ended, min_reward=0.5": SessionFilter(
                status=SessionStatus.ENDED, min_reward=0.5
            ),
            "min_version=3, max_version=4": SessionFilter(min_version=3, max_version=4),
            "min_prefix_breaks=1 (none match)": SessionFilter(min_prefix_breaks=1),
        }
        print("| session browser page (limit 50, with total) | median ms |")
        print("|---|---:|")
        for name, where in cases.items():
            ms = await timed(lambda w=where: store.list_sessions(run.id, w, limit=50), 10)
            print(f"| {name} | {ms:.1f} |")
        t0 = time.perf_counter()
        size = lines = 0
        async for line in jsonl(store, run.id, SessionFilter(), 1.0):
            size += len(line)
            lines += 1
        dt = time.perf_counter() - t0
        print(
            f"\nexport: {lines} sessions, {size / 1e6:.1f} MB in {dt:.2f} s = "
            f"{lines / dt:,.0f} sessions/s, {size / 1e6 / dt:.1f} MB/s"
        )
        t0 = time.perf_counter()
        await store.delete_run(run.id)
        print(f"delete the run with all its rows: {(time.perf_counter() - t0) * 1000:.0f} ms")
    finally:
        await store.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=2000)
    ap.add_argument("--database-url", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        url = args.database_url or f"sqlite:///{Path(tmp) / 'bench.db'}"
        asyncio.run(main(args.sessions, url))
