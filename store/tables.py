"""The ORM tables. The schema itself is created and changed only by the Alembic migrations in
`migrations/` (a test holds these models and the migrations together).

- `runs` 1-n `sessions` 1-n `segments` 1-n `completions`; `rewards` belong to a session and
  optionally to one completion.
- A segment's token arrays are not stored whole: each completion keeps its prompt *delta* (the
  prompt tokens after the segment's previous end) and its sampled ids, logprobs and versions, all
  as little-endian binary (`store.arrays`). A segment is the concatenation of its completions in
  turn order; `segments.length` is kept as the running total so a new turn can be checked
  against it without reading the arrays.
- `sessions.turn_count` numbers the session's completions across segments (`completions.turn`),
  which is the order returns are discounted in.
- The trainer's queue lives on `sessions`: `train_state` pending -> claimed (with
  `lease_owner`/`lease_expires_at`) -> consumed (`consumed_step`, the step that trained it or
  -1, and `outcome`: trained, stale, filtered, untrainable, incomplete or orphaned). A session
  its agent ends as failed is settled at once (outcome `failed`, its reason in `failure`).
- `runs.status` (active, paused, stopped) is what the operator set and the trainer obeys;
  `runs.key_hash` is the sha256 of the run's agent key. `train_steps` holds one row per
  trainer step (its metrics and checkpoint): the run's training time series.
- `policy_versions` holds every policy loaded into the gateway's engine (version, the directory
  it came from or NULL for in-process weights), so a restarted gateway serves the newest one.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    DateTime,
    Double,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    UniqueConstraint,
    false,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC datetime on every backend (SQLite keeps naive UTC text)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        assert value.tzinfo is not None, "store timestamps must be timezone-aware"
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class RunRow(Base):
    __tablename__ = "runs"
    # A unique index, not a constraint: SQLite adds an index without rebuilding the table.
    __table_args__ = (Index("ix_runs_key_hash", "key_hash", unique=True),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    config: Mapped[dict[str, Any]] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    key_hash: Mapped[str | None] = mapped_column(String(64))
    """sha256 hex of the run's agent key (creates and uses sessions of this run only)."""


class SessionRow(Base):
    __tablename__ = "sessions"
    __table_args__ = (
        Index("ix_sessions_run_id_group_id", "run_id", "group_id"),
        Index("ix_sessions_run_id_train_state_ended_at", "run_id", "train_state", "ended_at"),
        Index("ix_sessions_run_id_created_at", "run_id", "created_at"),
        Index("ix_sessions_run_id_consumed_step", "run_id", "consumed_step"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    group_id: Mapped[str | None] = mapped_column(String(200))
    meta: Mapped[dict[str, Any]] = mapped_column("metadata", JSON)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    """sha256 hex of the bearer key; the key itself is never stored."""
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    ended_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    prefix_breaks: Mapped[int] = mapped_column(Integer)
    turn_count: Mapped[int] = mapped_column(Integer)
    train_state: Mapped[str] = mapped_column(String(16))
    lease_owner: Mapped[str | None] = mapped_column(String(200))
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    consumed_step: Mapped[int | None] = mapped_column(Integer)
    outcome: Mapped[str | None] = mapped_column(String(16))
    """What became of the session once the trainer settled it (`store.types.Outcome`); NULL
    while it is not settled."""
    failure: Mapped[str | None] = mapped_column(String(500))
    """Why its agent ended it as failed (outcome `failed`), at most 500 characters; NULL
    otherwise."""


class SegmentRow(Base):
    __tablename__ = "segments"
    __table_args__ = (UniqueConstraint("session_id", "position"),)

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id", ondelete="CASCADE"))
    position: Mapped[int] = mapped_column(Integer)
    """The segment's index in its session (0, 1, ...)."""
    transcript: Mapped[dict[str, Any]] = mapped_column(JSON)
    length: Mapped[int] = mapped_column(Integer)
    """Tokens in the segment so far: the sum of its completions' delta and output lengths."""
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)


class CompletionRow(Base):
    __tablename__ = "completions"
    __table_args__ = (
        UniqueConstraint("session_id", "turn"),
        Index("ix_completions_segment_id_turn", "segment_id", "turn"),
    )

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id", ondelete="CASCADE"))
    segment_id: Mapped[str] = mapped_column(ForeignKey("segments.id", ondelete="CASCADE"))
    turn: Mapped[int] = mapped_column(Integer)
    prefix_len: Mapped[int] = mapped_column(Integer)
    prompt_delta: Mapped[bytes] = mapped_column(LargeBinary)
    """int32 prompt ids after the first `prefix_len` (those are the segment's earlier tokens)."""
    output_ids: Mapped[bytes] = mapped_column(LargeBinary)
    logprobs: Mapped[bytes] = mapped_column(LargeBinary)
    """float32, one per output id."""
    versions: Mapped[bytes] = mapped_column(LargeBinary)
    """int32 policy version that sampled each output id."""
    min_version: Mapped[int | None] = mapped_column(Integer)
    max_version: Mapped[int | None] = mapped_column(Integer)
    """The range of `versions` (None without output), so sessions filter by version in SQL."""
    finish_reason: Mapped[str] = mapped_column(String(32))
    status: Mapped[str] = mapped_column(String(16))
    """ok, aborted or replaced (`store.types.TurnStatus`); a replaced turn is outside its
    segment (not counted in `segments.length`)."""
    side: Mapped[str | None] = mapped_column(String(100))
    """The run's side request rule that matched the request (`store.run_config.SideRule`): a
    turn recorded, never trained. NULL: the agent's own turn."""
    sampling: Mapped[dict[str, Any]] = mapped_column(JSON)
    request: Mapped[dict[str, Any]] = mapped_column(JSON)
    response: Mapped[dict[str, Any]] = mapped_column(JSON)
    latency_ms: Mapped[float] = mapped_column(Double)
    ttft_ms: Mapped[float | None] = mapped_column(Double)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)


class RewardRow(Base):
    __tablename__ = "rewards"
    # NULL keys are distinct on both backends, so keyless rewards never collide.
    __table_args__ = (UniqueConstraint("session_id", "key"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id", ondelete="CASCADE"))
    completion_id: Mapped[str | None] = mapped_column(
        ForeignKey("completions.id", ondelete="CASCADE"), index=True
    )
    key: Mapped[str | None] = mapped_column(String(200))
    value: Mapped[float] = mapped_column(Double)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    late: Mapped[bool] = mapped_column(Boolean, server_default=false(), default=False)
    """Recorded after the session was settled (`late_rewards: record`): exported, never
    trained."""


class TrainStepRow(Base):
    __tablename__ = "train_steps"

    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    version: Mapped[int] = mapped_column(Integer)
    """The policy version this step published."""
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON)
    checkpoint: Mapped[str | None] = mapped_column(String(1000))
    """Where the step's checkpoint was saved (a path on the trainer's machine)."""
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)


class PolicyVersionRow(Base):
    __tablename__ = "policy_versions"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    """Insertion order: the newest row is the policy served last (versions can repeat, when a
    restarted trainer publishes a version again)."""
    version: Mapped[int] = mapped_column(Integer)
    path: Mapped[str | None] = mapped_column(String(4000))
    """The weights' model directory on the gateway's machine; NULL for in-process weights."""
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
