"""The run's trained sessions counted from an index: staleness admission, which counts a run's
accepted sessions each time sessions are made (under the run's lock), reads the trained ones
(`consumed_step >= 1`) from `ix_sessions_run_id_consumed_step` alone instead of joining every
session of the run's history with its rewards (BENCHMARKS.md, "Store").

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index(
        "ix_sessions_run_id_consumed_step", "sessions", ["run_id", "consumed_step"], unique=False
    )


def downgrade() -> None:
    op.drop_index("ix_sessions_run_id_consumed_step", table_name="sessions")
