"""Published policies: every policy version loaded into the gateway's engine.

- `policy_versions`: one row per load (`POST /admin/weights`, or an in-process trainer's
  publish), with the model directory the weights came from (NULL for in-process weights). The
  newest row (by `id`) is what a restarted gateway loads before it admits anything.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TIMESTAMP = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "policy_versions",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("path", sa.String(4000), nullable=True),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_policy_versions"),
    )


def downgrade() -> None:
    op.drop_table("policy_versions")
