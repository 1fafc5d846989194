"""Failed sessions: an agent (or the experiment runner) ends a session as failed, with a reason.

- `sessions.failure`: why its agent ended it as failed (at most 500 characters), set together
  with the outcome `failed` (`store.types.Outcome`); NULL otherwise. Nothing to backfill: no
  session failed before this revision. Downgrading keeps failed sessions settled (never
  trained) as `untrainable`, since the older revisions know no `failed`.

Columns are added (never tables rebuilt): on SQLite a rebuild would cascade deletes.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-04
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("sessions", sa.Column("failure", sa.String(500), nullable=True))


def downgrade() -> None:
    # The older revisions know no `failed` outcome: those sessions stay settled (step -1, never
    # trained) as `untrainable`, the one of their outcomes that says only that.
    sessions = sa.table("sessions", sa.column("outcome", sa.String()))
    op.execute(
        sa.update(sessions).where(sessions.c.outcome == "failed").values(outcome="untrainable")
    )
    op.drop_column("sessions", "failure")
