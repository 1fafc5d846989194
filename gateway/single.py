"""One gateway per SQLite file.

SQLite is the single-process store: a second gateway on the same file would keep its own live
session state and staleness admission beside the first one's, so it is refused at start with a
message that says to use PostgreSQL, which any number of gateways share (docs/architecture.md,
"Processes": a fleet of gateways). The claim is an exclusive `flock` on
`<database>.gateway.lock`, held for the gateway's lifetime and released by the kernel when its
process dies (`kill -9` included), so a restarted gateway is never locked out by a dead one. A
trainer process on the same file is not a gateway and is not refused.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy.engine import make_url

from store.db import normalize_url


class GatewayLockedError(RuntimeError):
    """Another gateway serves this SQLite file."""


def sqlite_file(database_url: str) -> Path | None:
    """The database file of an SQLite URL; None for PostgreSQL."""
    url = make_url(normalize_url(database_url))
    if url.get_backend_name() != "sqlite" or url.database is None:
        return None
    return Path(url.database).resolve()


@contextmanager
def sole_gateway(database_url: str) -> Iterator[None]:
    """Hold the SQLite file's gateway lock for the block (no-op on PostgreSQL); raise
    GatewayLockedError when another live process holds it."""
    database = sqlite_file(database_url)
    if database is None:
        yield
        return
    path = database.with_name(database.name + ".gateway.lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            raise GatewayLockedError(
                f"another gateway (pid {holder}) serves the SQLite database "
                f"{database}: SQLite takes one gateway. Stop it, or "
                "run several gateways on one PostgreSQL database (database_url=postgresql://...)"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock
