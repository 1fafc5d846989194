"""PostgreSQL: `rlgateway_turns_guard`, the check that ends the optimistic write of a batch of
turns (`store/turns_pg.py`). The write reads its sessions and segments without locking them and
writes in one statement that updates each only from the state it read; if any changed meanwhile,
the guard raises SQLSTATE RLG01, the whole statement is undone, and the batch is written again
under its sessions' row locks. SQLite needs none (its writer holds the database).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(
        """
        CREATE FUNCTION rlgateway_turns_guard(sessions_expected int, sessions_updated bigint,
                                              segments_expected int, segments_updated bigint)
        RETURNS bigint LANGUAGE plpgsql AS $$
        BEGIN
            IF sessions_updated <> sessions_expected OR segments_updated <> segments_expected THEN
                RAISE EXCEPTION 'a session or segment of this batch changed since it was read'
                    USING ERRCODE = 'RLG01';
            END IF;
            RETURN segments_updated;
        END
        $$
        """
    )


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("DROP FUNCTION rlgateway_turns_guard(int, bigint, int, bigint)")
