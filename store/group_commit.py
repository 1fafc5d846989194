"""Group commit: many concurrent `record_completions` calls share one transaction (one fsync).

SQLite commits one write transaction at a time, each with an fsync, so a burst of completions
that finish in the same decode step (64 of them, say) would queue for 64 fsyncs; PostgreSQL runs
them side by side, but each still pays its statements and its commit (BENCHMARKS.md, "Store":
grouped, 16 writers commit 1.3-1.5x more there, 1.65x more on SQLite). Here the first
caller starts a drain task; every caller that arrives while a transaction is running joins the
next one, and the whole group is written as one batch (`store.turns.write_batch`: a handful
of set-based statements, not a handful per caller). If that fails, the group is retried with a
SAVEPOINT per caller, so one caller's failure (an ended session, a conflict) rolls back only its
records and is raised to that caller alone; the others commit together. A caller returns only
after the transaction holding its records committed.
"""

from __future__ import annotations

import asyncio

from store.db import Database
from store.turn_plan import check_records
from store.turns import write_batch, write_isolated
from store.types import CompletionRecord

_Job = tuple[list[CompletionRecord], asyncio.Future[None]]

IN_FLIGHT_POSTGRES = 2
"""Group transactions a PostgreSQL store runs at once: while one commits, the next group is
written (BENCHMARKS.md, "Store": 2 measured best of 1, 2, 4 and 8)."""


class GroupCommitter:
    """Groups concurrent `record` calls into transactions, at most `in_flight` at once (one on
    SQLite, which writes one transaction at a time; a few on PostgreSQL, which overlaps them)."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self.in_flight = 1 if db.dialect == "sqlite" else IN_FLIGHT_POSTGRES
        self._pending: list[_Job] = []
        self._drains: set[asyncio.Task[None]] = set()

    async def record(self, records: list[CompletionRecord]) -> None:
        check_records(records)
        if not records:
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((records, future))
        # a drain whose loop found nothing pending is done at once (a done-callback would run
        # later, and a job that came between would wait for a drain that never looks again)
        self._drains = {t for t in self._drains if not t.done()}
        if len(self._drains) < self.in_flight:
            self._drains.add(asyncio.create_task(self._run()))
        await future

    async def _run(self) -> None:
        while self._pending:
            jobs, self._pending = self._pending, []
            group = [r for records, _ in jobs for r in records]
            try:  # the common case: everything commits, without a savepoint per caller
                await write_batch(self.db, group)
            except Exception:
                errors = await write_isolated(self.db, [records for records, _ in jobs])
            else:
                errors = [None] * len(jobs)
            for (_, future), error in zip(jobs, errors, strict=True):
                if future.done():
                    continue
                if error is None:
                    future.set_result(None)
                else:
                    future.set_exception(error)
