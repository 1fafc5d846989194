"""Database URLs, engines and transactions.

SQLite (the default; one file, WAL journal, foreign keys on) or PostgreSQL, both through async
drivers (aiosqlite, asyncpg). Every store call opens one short transaction from
`Database.read()` or `Database.write()`:

- On PostgreSQL both come from one connection pool; row locks (`FOR UPDATE`) order writers.
- On SQLite a write transaction starts with `BEGIN IMMEDIATE`, taking the file's write lock up
  front, so a transaction never has to upgrade a read lock (which fails at once with "database is
  locked" whatever the busy timeout). Writers in this process also queue on an asyncio lock, so
  they wait without spinning in SQLite's busy handler; writers in other processes (the trainer
  beside the gateway) wait in the busy handler for up to `SQLITE_BUSY_TIMEOUT_S`. Reads take no
  lock and, under WAL, never block or get blocked by the writer.

`Database.write_sync(fn)` runs a synchronous function on a Connection in one write transaction:
the gateway's hot path (recording turns) is written that way. On SQLite the whole transaction
runs in one call to a dedicated writer thread holding a plain `sqlite3` connection. aiosqlite
crosses to its thread and back once per statement, and those crossings, not SQLite, were most of
a turn's commit time (8.8 ms for eight statements and an fsync that takes 0.4 ms here). On
PostgreSQL it runs through `AsyncConnection.run_sync` on the async pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)

from store.errors import StoreError

if TYPE_CHECKING:  # asyncpg is imported where PostgreSQL is used (SQLAlchemy's dialect)
    import asyncpg

SQLITE_BUSY_TIMEOUT_S = 30.0
_WRITE_OPTION = "rlgateway_write"
_ACCEPTED = (
    "sqlite:///PATH, sqlite+aiosqlite:///PATH, postgresql://USER@HOST:PORT/DB or "
    "postgresql+asyncpg://USER@HOST:PORT/DB"
)


def normalize_url(url: str) -> str:
    """The URL with its async driver: sqlite -> sqlite+aiosqlite, postgresql -> +asyncpg.

    Raises ValueError for any other form, and for an SQLite URL without a file path (the store is
    durable; an in-memory database is not).
    """
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise ValueError(f"cannot parse database URL {url!r}: use {_ACCEPTED}") from exc
    drivers = {
        "sqlite": "sqlite+aiosqlite",
        "sqlite+aiosqlite": "sqlite+aiosqlite",
        "postgresql": "postgresql+asyncpg",
        "postgres": "postgresql+asyncpg",
        "postgresql+asyncpg": "postgresql+asyncpg",
    }
    driver = drivers.get(parsed.drivername)
    if driver is None:
        raise ValueError(
            f"unsupported database URL scheme {parsed.drivername!r} in "
            f"{_redacted(parsed)!r}: use {_ACCEPTED}"
        )
    if driver.startswith("sqlite") and parsed.database in (None, "", ":memory:"):
        raise ValueError(
            f"an SQLite URL needs a file path, e.g. sqlite:///rlgateway.db (got {url!r}); "
            "in-memory databases are not durable"
        )
    if driver.startswith("postgresql") and not parsed.database:
        raise ValueError(f"a PostgreSQL URL needs a database name (got {_redacted(parsed)!r})")
    return parsed.set(drivername=driver).render_as_string(hide_password=False)


def redact(url: str) -> str:
    """The URL with its password masked, for messages and logs."""
    return _redacted(make_url(url))


def _redacted(url: URL) -> str:
    return url.render_as_string(hide_password=True)


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_id(prefix: str) -> str:
    """`prefix_` followed by 24 random hex digits."""
    return f"{prefix}_{secrets.token_hex(12)}"


_T = TypeVar("_T")


def _sqlite_engine(url: str) -> AsyncEngine:
    engine = create_async_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_S})
    _sqlite_events(engine.sync_engine)
    return engine


def _sqlite_events(engine: Engine) -> None:
    """WAL, foreign keys and the busy timeout on every connection; BEGIN IMMEDIATE for writes."""

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # SQLAlchemy, not the sqlite3 module, emits BEGIN (see _on_begin).
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute(f"PRAGMA busy_timeout={int(SQLITE_BUSY_TIMEOUT_S * 1000)}")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        write = conn.get_execution_options().get(_WRITE_OPTION, False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")


class _SQLiteWriter:
    """One thread with one synchronous `sqlite3` connection, for `Database.write_sync`."""

    def __init__(self, url: str) -> None:
        sync_url = make_url(url).set(drivername="sqlite+pysqlite")
        engine = create_engine(
            sync_url,
            connect_args={"timeout": SQLITE_BUSY_TIMEOUT_S, "check_same_thread": False},
            pool_size=1,
            max_overflow=0,
        )
        _sqlite_events(engine)
        self.engine = engine.execution_options(**{_WRITE_OPTION: True})
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="rlgateway-sqlite-writer")

    async def run(self, fn: Callable[[Connection], _T]) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, self._transaction, fn)

    def _transaction(self, fn: Callable[[Connection], _T]) -> _T:
        with self.engine.begin() as conn:
            return fn(conn)

    def close(self) -> None:
        """Close the connection on its own thread and stop the thread. Idempotent."""
        with contextlib.suppress(RuntimeError):  # shut down already
            self._thread.submit(self.engine.dispose).result()
        self._thread.shutdown()


class Database:
    """One engine and its read and write transaction factories."""

    def __init__(self, url: str) -> None:
        self.url = normalize_url(url)
        self.dialect = make_url(self.url).get_backend_name()
        if self.dialect == "sqlite":
            self.engine = _sqlite_engine(self.url)
            self._write_lock: asyncio.Lock | None = asyncio.Lock()
            self._sqlite_writer: _SQLiteWriter | None = _SQLiteWriter(self.url)
        else:
            self.engine = create_async_engine(self.url, pool_size=10, max_overflow=20)
            self._write_lock = None
            self._sqlite_writer = None
        self.write_engine = self.engine.execution_options(**{_WRITE_OPTION: True})
        self._reader = async_sessionmaker(self.engine, expire_on_commit=False)
        self._writer = async_sessionmaker(self.write_engine, expire_on_commit=False)

    async def ping(self) -> None:
        """Connect once (creating an SQLite file's directory first); a StoreError says which URL
        failed and what to check."""
        try:
            if self.dialect == "sqlite":
                Path(make_url(self.url).database or "").parent.mkdir(parents=True, exist_ok=True)
            async with self.engine.connect() as conn:
                await conn.execute(text("SELECT 1"))
        except (OSError, DBAPIError) as exc:
            hint = (
                "check that the directory is writable"
                if self.dialect == "sqlite"
                else "check that the server is running and reachable, and that the user, "
                "password and database in the URL exist (create one with `createdb NAME`)"
            )
            detail = exc.orig if isinstance(exc, DBAPIError) else exc
            raise StoreError(f"cannot connect to {redact(self.url)}: {detail}; {hint}") from exc

    @asynccontextmanager
    async def read(self) -> AsyncIterator[AsyncSession]:
        """A read-only transaction (rolled back at the end)."""
        async with self._reader() as session:
            yield session

    @asynccontextmanager
    async def write(self) -> AsyncIterator[AsyncSession]:
        """A write transaction: committed if the block succeeds, rolled back if it raises."""
        if self._write_lock is None:
            async with self._writer.begin() as session:
                yield session
            return
        async with self._write_lock, self._writer.begin() as session:
            yield session

    async def write_sync(self, fn: Callable[[Connection], _T]) -> _T:
        """`fn(connection)` in one write transaction (committed if it returns, rolled back if it
        raises), for synchronous store code on the hot path. On SQLite it runs on the writer
        thread, queued behind this process's other writers like `write()`; the caller's task may
        be cancelled, but a transaction that started runs to its end."""
        if self._sqlite_writer is None:
            async with self.write_engine.begin() as conn:
                return await conn.run_sync(fn)
        assert self._write_lock is not None
        async with self._write_lock:
            return await asyncio.shield(self._sqlite_writer.run(fn))

    @asynccontextmanager
    async def pg_connection(self) -> AsyncIterator[asyncpg.Connection]:
        """PostgreSQL only: the asyncpg connection under one of the pool's connections, for the
        hot paths written against the driver (`store.turns_pg`). Each statement on it commits on
        its own unless it is run inside `connection.transaction()`."""
        assert self.dialect == "postgresql", "an asyncpg connection exists on PostgreSQL only"
        async with self.write_engine.connect() as conn:
            raw = await conn.get_raw_connection()
            yield raw.driver_connection

    @asynccontextmanager
    async def pg_transaction(self) -> AsyncIterator[asyncpg.Connection]:
        """`pg_connection()` in one transaction: committed if the block succeeds, rolled back if
        it raises."""
        async with self.pg_connection() as conn, conn.transaction():
            yield conn

    @property
    def sync_engines(self) -> list[Engine]:
        """Every synchronous engine statements go through (for event listeners)."""
        engines = [self.engine.sync_engine]
        if self._sqlite_writer is not None:
            engines.append(self._sqlite_writer.engine.engine)
        return engines

    async def dispose(self) -> None:
        await self.engine.dispose()
        if self._sqlite_writer is not None:
            await asyncio.to_thread(self._sqlite_writer.close)
