"""Store fixtures on both backends: a fresh SQLite file, and a fresh PostgreSQL database.

PostgreSQL is the server at RLGATEWAY_TEST_POSTGRES_URL (default
postgresql://postgres@127.0.0.1:5432/test); each `store_url` module gets its own database
`rlg_test_<hex>` there, dropped afterwards. Tests share that database within a module and keep
apart by creating their own run.

Use from a test module with `from tests.store_fixtures import store, store_url  # noqa: F401`.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any, TypeVar

import asyncpg
import pytest
from sqlalchemy.engine import make_url

from store import Store

POSTGRES_URL = os.environ.get(
    "RLGATEWAY_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
)
T = TypeVar("T")


def _in_thread(make: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run a coroutine to completion on a private loop in another thread, so a sync fixture can
    use asyncpg without touching the event loop pytest-asyncio gives the tests."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(make())
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]


def _asyncpg_dsn(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


async def _admin(sql: str) -> None:
    conn = await asyncpg.connect(_asyncpg_dsn(POSTGRES_URL), timeout=5)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


def create_postgres_database() -> str:
    """A new empty database on the test server; returns its URL. Skips if none is reachable."""
    name = f"rlg_test_{secrets.token_hex(6)}"
    try:
        _in_thread(lambda: _admin(f'CREATE DATABASE "{name}"'))
    except (OSError, asyncpg.PostgresError, TimeoutError) as exc:
        pytest.skip(
            f"PostgreSQL is not reachable at {POSTGRES_URL} ({exc}): start it, or point "
            "RLGATEWAY_TEST_POSTGRES_URL at a server where this user may CREATE DATABASE"
        )
    return make_url(POSTGRES_URL).set(database=name).render_as_string(hide_password=False)


def drop_postgres_database(url: str) -> None:
    name = make_url(url).database
    _in_thread(lambda: _admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


@pytest.fixture(scope="module", params=BACKENDS)
def store_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A database URL, empty when first used in the module; one per backend."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp('store')}/store.db"
        return
    url = create_postgres_database()
    yield url
    drop_postgres_database(url)


@pytest.fixture(scope="module")
def postgres_url() -> Iterator[str]:
    """An empty PostgreSQL database for the module, for tests of PostgreSQL alone."""
    url = create_postgres_database()
    yield url
    drop_postgres_database(url)


@pytest.fixture
def fresh_url(request: pytest.FixtureRequest, store_url: str, tmp_path: Any) -> Iterator[str]:
    """An empty database of the same backend as `store_url`, for this test alone."""
    if store_url.startswith("sqlite"):
        yield f"sqlite:///{tmp_path}/fresh.db"
        return
    url = create_postgres_database()
    yield url
    drop_postgres_database(url)


@pytest.fixture
async def store(store_url: str) -> AsyncIterator[Store]:
    """A connected, migrated `Store` on `store_url`."""
    s = await Store.connect(store_url)
    yield s
    await s.close()
