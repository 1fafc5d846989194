"""Side requests: a turn the run's rules mark as an agent CLI's side request (a title, a quota
check) is recorded and never trained (`store.run_config`, side requests).

- `completions.side`: the name of the rule that matched its request (at most 100 characters);
  NULL for the agent's own turns, which every turn recorded before this revision is. Downgrading
  drops the marks: those turns become trainable turns again, as the older revisions know no
  other kind.

Columns are added (never tables rebuilt): on SQLite a rebuild would cascade deletes.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-04
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("completions", sa.Column("side", sa.String(100), nullable=True))


def downgrade() -> None:
    op.drop_column("completions", "side")
