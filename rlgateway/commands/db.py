"""`rlgateway db upgrade|current [--database-url URL]`: migrate the store's schema, or show it.

The URL comes from --database-url, else RLGATEWAY_DATABASE_URL, else sqlite:///rlgateway.db.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path
from typing import TYPE_CHECKING

from rlgateway.errors import CLIError

if TYPE_CHECKING:
    from store.db import Database

DEFAULT_DATABASE_URL = "sqlite:///rlgateway.db"


def database_url(arg: str | None) -> str:
    """The database URL a command uses: the flag, else the environment, else the default."""
    return arg or os.environ.get("RLGATEWAY_DATABASE_URL") or DEFAULT_DATABASE_URL


def run_db(args: argparse.Namespace) -> int:
    from sqlalchemy.engine import make_url

    from store import StoreError
    from store.db import Database, redact

    try:
        db = Database(database_url(args.database_url))
    except ValueError as exc:
        raise CLIError(f"{exc} (from --database-url or RLGATEWAY_DATABASE_URL)") from exc
    shown = redact(db.url)
    if args.db_command == "current" and db.dialect == "sqlite":
        path = Path(make_url(db.url).database or "")
        if not path.is_file():
            raise CLIError(
                f"no SQLite database at {path.resolve()}: create it with `rlgateway db upgrade`, "
                "or pass --database-url"
            )
    try:
        line = asyncio.run(_command(db, args.db_command))
    except StoreError as exc:
        raise CLIError(str(exc)) from exc
    print(f"{shown}: {line}")
    return 0


async def _command(db: Database, command: str) -> str:
    from store import migrate

    if command == "current":
        current, head = await migrate.revisions(db)
        if current is None:
            return "no schema yet (empty database): run `rlgateway db upgrade`"
        if current == head:
            return f"{current} (head)"
        return f"{current} (head is {head}: run `rlgateway db upgrade`)"
    if command == "upgrade":
        before, head = await migrate.revisions(db)  # reachable, and a revision it knows
        try:
            await migrate.upgrade(db)
        finally:
            await db.dispose()
        if before == head:
            return f"already at revision {head} (head)"
        return f"upgraded from {before or 'an empty database'} to revision {head} (head)"
    raise AssertionError(f"unhandled db command {command!r}")
