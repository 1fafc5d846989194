"""The published policies: every policy version loaded into the gateway's engine, newest last.

The gateway records each load (`POST /admin/weights` with the directory it loaded, an
in-process trainer's publish with none) so that a restarted gateway can serve the newest policy
again before it admits any agent. Rows are only added: a version published again (a restarted
trainer's resume) is a new row, and the newest row is the one inserted last, whatever its
version.
"""

from __future__ import annotations

from sqlalchemy import select

from store.db import Database, utcnow
from store.tables import PolicyVersionRow
from store.types import PublishedPolicy


async def record_policy(db: Database, version: int, path: str | None) -> PublishedPolicy:
    """Record that the engine now serves `version`, loaded from `path` (None: in process)."""
    if version < 0:
        raise ValueError(f"a policy version is >= 0, got {version}")
    row = PolicyVersionRow(version=version, path=path, created_at=utcnow())
    async with db.write() as s:
        s.add(row)
    return PublishedPolicy(version=row.version, path=row.path, created_at=row.created_at)


async def latest_policy(db: Database) -> PublishedPolicy | None:
    """The policy recorded last, or None before any was."""
    async with db.read() as s:
        row = await s.scalar(select(PolicyVersionRow).order_by(PolicyVersionRow.id.desc()).limit(1))
    if row is None:
        return None
    return PublishedPolicy(version=row.version, path=row.path, created_at=row.created_at)
