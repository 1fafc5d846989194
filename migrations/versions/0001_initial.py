"""Initial schema: runs, sessions, segments, completions, rewards.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Migrations spell their types out rather than import the ORM's, so later model changes cannot
# rewrite history. store.tables.UTCDateTime is a DateTime(timezone=True) underneath.
TIMESTAMP = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_runs"),
    )
    op.create_table(
        "sessions",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("run_id", sa.String(32), nullable=False),
        sa.Column("group_id", sa.String(200), nullable=True),
        sa.Column("metadata", sa.JSON(), nullable=False),
        sa.Column("key_hash", sa.String(64), nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("ended_at", TIMESTAMP, nullable=True),
        sa.Column("prefix_breaks", sa.Integer(), nullable=False),
        sa.Column("turn_count", sa.Integer(), nullable=False),
        sa.Column("train_state", sa.String(16), nullable=False),
        sa.Column("lease_owner", sa.String(200), nullable=True),
        sa.Column("lease_expires_at", TIMESTAMP, nullable=True),
        sa.Column("consumed_step", sa.Integer(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_sessions"),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name="fk_sessions_run_id_runs", ondelete="CASCADE"
        ),
        sa.UniqueConstraint("key_hash", name="uq_sessions_key_hash"),
    )
    op.create_index("ix_sessions_run_id_group_id", "sessions", ["run_id", "group_id"])
    op.create_index(
        "ix_sessions_run_id_train_state_ended_at",
        "sessions",
        ["run_id", "train_state", "ended_at"],
    )
    op.create_table(
        "segments",
        sa.Column("id", sa.String(128), nullable=False),
        sa.Column("session_id", sa.String(32), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("transcript", sa.JSON(), nullable=False),
        sa.Column("length", sa.Integer(), nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_segments"),
        sa.ForeignKeyConstraint(
            ["session_id"],
            ["sessions.id"],
            name="fk_segments_session_id_sessions",
            ondelete="CASCADE",
        ),
        sa.UniqueConstraint("session_id", "position", name="uq_segments_session_id_position"),
    )
    op.create_table(
        "completions",
        sa.Column("id", sa.String(128), nullable=False),
        sa.Column("session_id", sa.String(32), nullable=False),
        sa.Column("segment_id", sa.String(128), nullable=False),
        sa.Column("turn", sa.Integer(), nullable=False),
        sa.Column("prefix_len", sa.Integer(), nullable=False),
        sa.Column("prompt_delta", sa.LargeBinary(), nullable=False),
        sa.Column("output_ids", sa.LargeBinary(), nullable=False),
        sa.Column("logprobs", sa.LargeBinary(), nullable=False),
        sa.Column("versions", sa.LargeBinary(), nullable=False),
        sa.Column("finish_reason", sa.String(32), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("sampling", sa.JSON(), nullable=False),
        sa.Column("request", sa.JSON(), nullable=False),
        sa.Column("response", sa.JSON(), nullable=False),
        sa.Column("latency_ms", sa.Double(), nullable=False),
        sa.Column("ttft_ms", sa.Double(), nullable=True),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_completions"),
        sa.ForeignKeyConstraint(
            ["session_id"],
            ["sessions.id"],
            name="fk_completions_session_id_sessions",
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["segment_id"],
            ["segments.id"],
            name="fk_completions_segment_id_segments",
            ondelete="CASCADE",
        ),
        sa.UniqueConstraint("session_id", "turn", name="uq_completions_session_id_turn"),
    )
    op.create_index("ix_completions_segment_id_turn", "completions", ["segment_id", "turn"])
    op.create_table(
        "rewards",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("session_id", sa.String(32), nullable=False),
        sa.Column("completion_id", sa.String(128), nullable=True),
        sa.Column("key", sa.String(200), nullable=True),
        sa.Column("value", sa.Double(), nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_rewards"),
        sa.ForeignKeyConstraint(
            ["session_id"],
            ["sessions.id"],
            name="fk_rewards_session_id_sessions",
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["completion_id"],
            ["completions.id"],
            name="fk_rewards_completion_id_completions",
            ondelete="CASCADE",
        ),
        # NULL keys are distinct on both backends, so keyless rewards never collide.
        sa.UniqueConstraint("session_id", "key", name="uq_rewards_session_id_key"),
    )
    op.create_index("ix_rewards_completion_id", "rewards", ["completion_id"])


def downgrade() -> None:
    op.drop_table("rewards")
    op.drop_table("completions")
    op.drop_table("segments")
    op.drop_table("sessions")
    op.drop_table("runs")
