"""Every SQL statement a store sends, on either backend, for tests that count them.

SQLite's statements all go through SQLAlchemy (its `before_cursor_execute` event); PostgreSQL's
hot paths go to asyncpg directly (`store.turns_pg`), so there each connection the pool hands out
gets an asyncpg query logger, which sees SQLAlchemy's statements and the raw ones alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from sqlalchemy import event

from store import Store

_SKIPPED = ("BEGIN", "COMMIT", "PRAGMA", "SAVEPOINT", "RELEASE", "ROLLBACK")
_INTROSPECTION = ("set_config('jit'", "typeinfo_tree")
"""asyncpg's look-ups of a statement's types, once per connection and type."""


@contextlib.contextmanager
def statements_of(*stores: Store) -> Iterator[list[str]]:
    """The statements the stores send while the block runs (transaction control and the
    driver's type look-ups left out)."""
    statements: list[str] = []
    logged: list[Any] = []

    def keep(statement: str) -> None:
        if statement.lstrip().upper().startswith(_SKIPPED):
            return
        if not any(marker in statement for marker in _INTROSPECTION):
            statements.append(statement)

    def on_cursor(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        keep(statement)

    def on_query(query: Any) -> None:
        keep(query.query)

    def on_checkout(dbapi_connection: Any, *_args: Any) -> None:
        driver = dbapi_connection.driver_connection
        if driver not in logged:
            driver.add_query_logger(on_query)
            logged.append(driver)

    listeners: list[tuple[Any, str, Any]] = []
    for store in stores:
        db = store._db
        for engine in db.sync_engines:
            if db.dialect == "postgresql":
                listeners.append((engine.pool, "checkout", on_checkout))
            else:
                listeners.append((engine, "before_cursor_execute", on_cursor))
    for target, name, fn in listeners:
        event.listen(target, name, fn)
    try:
        yield statements
    finally:
        for target, name, fn in listeners:
            event.remove(target, name, fn)
        for driver in logged:
            driver.remove_query_logger(on_query)
