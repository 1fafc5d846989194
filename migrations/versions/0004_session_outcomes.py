"""Session outcomes and late rewards: nothing the trainer takes is dropped in silence.

- `sessions.outcome`: what became of a session the trainer settled (`store.types.Outcome`:
  trained, stale, filtered, untrainable, incomplete, orphaned); NULL while it is not settled.
  Sessions consumed before this revision are backfilled: `trained` at a step >= 1, `stale` at
  step -1 (the only outcome recorded then under that step was a drop, mostly stale).
- `rewards.late`: a reward recorded after the session was settled (a run whose config says
  `late_rewards: record`): kept for the export, never trained.

Columns are added (never tables rebuilt): on SQLite a rebuild would cascade deletes.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("sessions", sa.Column("outcome", sa.String(16), nullable=True))
    op.add_column(
        "rewards",
        sa.Column("late", sa.Boolean(), nullable=False, server_default=sa.false()),
    )
    sessions = sa.table(
        "sessions",
        sa.column("outcome", sa.String()),
        sa.column("train_state", sa.String()),
        sa.column("consumed_step", sa.Integer()),
    )
    consumed = sessions.c.train_state == "consumed"
    op.execute(
        sa.update(sessions).where(consumed, sessions.c.consumed_step >= 0).values(outcome="trained")
    )
    op.execute(
        sa.update(sessions).where(consumed, sessions.c.consumed_step < 0).values(outcome="stale")
    )


def downgrade() -> None:
    op.drop_column("rewards", "late")
    op.drop_column("sessions", "outcome")
