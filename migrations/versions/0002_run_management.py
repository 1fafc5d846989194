"""Run management: run status and agent keys, version ranges per completion, training steps.

- `runs.key_hash`: sha256 of the run's agent key (unique index; NULL for runs made before).
- `completions.min_version` / `max_version`: the range of a turn's policy versions, so sessions
  can be filtered by version in SQL; filled in here for existing rows.
- `train_steps`: one row per trainer step (metrics JSON, checkpoint path), the time series the
  admin API and the page chart.
- `ix_sessions_run_id_created_at`: the session browser's order.

Columns are added (never tables rebuilt): on SQLite a rebuild of `runs` would cascade deletes.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TIMESTAMP = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.add_column("runs", sa.Column("key_hash", sa.String(64), nullable=True))
    op.create_index("ix_runs_key_hash", "runs", ["key_hash"], unique=True)
    op.add_column("completions", sa.Column("min_version", sa.Integer(), nullable=True))
    op.add_column("completions", sa.Column("max_version", sa.Integer(), nullable=True))
    op.create_index("ix_sessions_run_id_created_at", "sessions", ["run_id", "created_at"])
    op.create_table(
        "train_steps",
        sa.Column("run_id", sa.String(32), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("checkpoint", sa.String(1000), nullable=True),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.PrimaryKeyConstraint("run_id", "step", name="pk_train_steps"),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name="fk_train_steps_run_id_runs", ondelete="CASCADE"
        ),
    )
    _backfill_version_ranges()


def _backfill_version_ranges() -> None:
    conn = op.get_bind()
    completions = sa.table(
        "completions",
        sa.column("id", sa.String()),
        sa.column("versions", sa.LargeBinary()),
        sa.column("min_version", sa.Integer()),
        sa.column("max_version", sa.Integer()),
    )
    rows = conn.execute(sa.select(completions.c.id, completions.c.versions)).all()
    for cid, blob in rows:
        # int32 little-endian, as store.arrays writes them (spelled out: migrations are frozen).
        versions = struct.unpack(f"<{len(blob) // 4}i", blob)
        if versions:
            conn.execute(
                sa.update(completions)
                .where(completions.c.id == cid)
                .values(min_version=min(versions), max_version=max(versions))
            )


def downgrade() -> None:
    op.drop_table("train_steps")
    op.drop_index("ix_sessions_run_id_created_at", table_name="sessions")
    # Plain ALTER TABLE ... DROP COLUMN (SQLite >= 3.35), not a batch rebuild (see above).
    op.drop_column("completions", "max_version")
    op.drop_column("completions", "min_version")
    op.drop_index("ix_runs_key_hash", table_name="runs")
    op.drop_column("runs", "key_hash")
