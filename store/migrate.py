"""Run the Alembic migrations in `migrations/` from code (no alembic.ini needed).

Each command runs inside one write transaction on the store's own engine (Alembic's "connection
sharing" recipe), so it works from inside a running event loop and, on SQLite, holds the write
lock for the whole upgrade. On PostgreSQL a transaction-scoped advisory lock makes processes that
start together (gateway and trainer) upgrade one after the other instead of racing.
"""

from __future__ import annotations

from importlib.resources import files

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util.exc import CommandError
from sqlalchemy import Connection, text

from store.db import Database, redact
from store.errors import StoreError

_PG_MIGRATION_LOCK = 0x726C6777  # "rlgw": any constant shared by every rlgateway process


def alembic_config(url: str) -> Config:
    """An Alembic config for `url` with script_location at the installed `migrations` package."""
    cfg = Config()
    cfg.set_main_option("script_location", str(files("migrations")))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def _scripts() -> ScriptDirectory:
    return ScriptDirectory.from_config(alembic_config("sqlite://"))


def head_revision() -> str:
    head = _scripts().get_current_head()
    assert head is not None, "the migrations package has no revisions"
    return head


def check_known(revision: str | None, db: Database) -> None:
    """StoreError if the database is at a revision this installation has no migration for
    (a newer rlgateway migrated it)."""
    if revision is None:
        return
    try:
        _scripts().get_revision(revision)
    except CommandError as exc:
        raise StoreError(
            f"database {redact(db.url)} is at schema revision {revision!r}, which this "
            f"rlgateway does not know (its newest is {head_revision()}): upgrade rlgateway, or "
            "use another database"
        ) from exc


async def current_revision(db: Database) -> str | None:
    """The database's revision, or None for an empty (never upgraded) database."""
    async with db.engine.connect() as conn:
        return await conn.run_sync(_current)


async def revisions(db: Database) -> tuple[str | None, str]:
    """(the database's revision or None when empty, this installation's head); StoreError
    when the server cannot be reached or the database is at a revision this rlgateway does not
    know. Disposes of `db`'s connections."""
    try:
        await db.ping()
        current = await current_revision(db)
        check_known(current, db)
        return current, head_revision()
    finally:
        await db.dispose()


async def upgrade(db: Database, revision: str = "head") -> None:
    check_known(await current_revision(db), db)
    await _run(db, "upgrade", revision)


async def downgrade(db: Database, revision: str) -> None:
    await _run(db, "downgrade", revision)


async def _run(db: Database, action: str, revision: str) -> None:
    async with db.write_engine.begin() as conn:
        if db.dialect == "postgresql":
            await conn.execute(
                text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_MIGRATION_LOCK}
            )
        await conn.run_sync(_alembic, db.url, action, revision)


def _alembic(conn: Connection, url: str, action: str, revision: str) -> None:
    cfg = alembic_config(url)
    cfg.attributes["connection"] = conn
    if action == "upgrade":
        command.upgrade(cfg, revision)
    else:
        command.downgrade(cfg, revision)


def _current(conn: Connection) -> str | None:
    return MigrationContext.configure(conn).get_current_revision()
