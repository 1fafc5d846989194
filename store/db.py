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
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import event, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)

from store.errors import StoreError

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


def _sqlite_engine(url: str) -> AsyncEngine:
    engine = create_async_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_S})

    @event.listens_for(engine.sync_engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # SQLAlchemy, not the sqlite3 module, emits BEGIN (see _on_begin).
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute(f"PRAGMA busy_timeout={int(SQLITE_BUSY_TIMEOUT_S * 1000)}")
        cursor.close()

    @event.listens_for(engine.sync_engine, "begin")
    def _on_begin(conn: Any) -> None:
        write = conn.get_execution_options().get(_WRITE_OPTION, False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

    return engine


class Database:
    """One engine and its read and write transaction factories."""

    def __init__(self, url: str) -> None:
        self.url = normalize_url(url)
        self.dialect = make_url(self.url).get_backend_name()
        if self.dialect == "sqlite":
            self.engine = _sqlite_engine(self.url)
            self._write_lock: asyncio.Lock | None = asyncio.Lock()
        else:
            self.engine = create_async_engine(self.url, pool_size=10, max_overflow=20)
            self._write_lock = None
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

    async def dispose(self) -> None:
        await self.engine.dispose()
