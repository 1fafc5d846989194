"""Alembic environment. `store.migrate` passes its own connection in `config.attributes`; run from
the `alembic` command line instead (`alembic -c migrations/alembic.ini ...`), it connects to
`sqlalchemy.url`, or to RLGATEWAY_DATABASE_URL when that is empty.
"""

from __future__ import annotations

import asyncio
import os

from alembic import context
from sqlalchemy import Connection

from store.db import Database
from store.tables import Base

config = context.config
target_metadata = Base.metadata


def do_run_migrations(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        # SQLite can alter a table only by copying it; batch mode does that.
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


async def run_async_migrations(url: str) -> None:
    db = Database(url)  # the store's own engine setup (SQLite: WAL, BEGIN IMMEDIATE)
    try:
        async with db.write_engine.connect() as connection:
            await connection.run_sync(do_run_migrations)
    finally:
        await db.dispose()


def main() -> None:
    if context.is_offline_mode():
        raise SystemExit("offline (--sql) migrations are not supported: run against a database")
    connection = config.attributes.get("connection")
    if connection is not None:
        do_run_migrations(connection)
        return
    url = config.get_main_option("sqlalchemy.url") or os.environ.get("RLGATEWAY_DATABASE_URL")
    if not url:
        raise SystemExit("set sqlalchemy.url or RLGATEWAY_DATABASE_URL to the database to migrate")
    asyncio.run(run_async_migrations(url))


main()
