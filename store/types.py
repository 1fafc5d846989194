"""Typed records that cross the store's boundary (to the gateway, the trainer and the admin API).

Token arrays are plain Python lists here; in the database they are compact little-endian binary
(int32 for ids and versions, float32 for logprobs, uint8 for the loss mask): see `store.arrays`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

JSON = dict[str, Any]


class SessionStatus(enum.StrEnum):
    ACTIVE = "active"
    ENDED = "ended"


class TurnStatus(enum.StrEnum):
    OK = "ok"
    ABORTED = "aborted"
    """The reply never reached the client whole (it went away, timed out, or the engine failed
    mid-stream); the turn holds what was generated until then. It is not trained nor exported by
    default: a later turn of its segment keeps its tokens as context only."""
    REPLACED = "replaced"
    """A retry of the same request took its place (the client never received this reply): the
    turn is kept in the store but is no longer part of its segment, in any view."""


class TrainState(enum.StrEnum):
    PENDING = "pending"
    CLAIMED = "claimed"
    CONSUMED = "consumed"


class Outcome(enum.StrEnum):
    """What became of a session the trainer settled (`sessions.outcome`): every session it
    takes ends in exactly one of these, none in silence."""

    TRAINED = "trained"
    """Trained at step `consumed_step` (>= 1)."""
    STALE = "stale"
    """Every trainable token was older than `eta` policy versions (or, with `stale_tokens:
    drop`, any one was)."""
    FILTERED = "filtered"
    """Left out by dynamic sampling: its group's task rewards were all equal."""
    UNTRAINABLE = "untrainable"
    """Nothing the trainer can train: no sampled token, or only turns sampled under a
    distribution it cannot reproduce (the sampling contract)."""
    INCOMPLETE = "incomplete"
    """Its group missed its deadline short of `group_size` members, under `partial_groups:
    drop`."""
    ORPHANED = "orphaned"
    """Never ended, idle past `session_idle_seconds`, and holding no reward: ended by the
    trainer."""
    FAILED = "failed"
    """Ended by its agent (or the experiment runner) as failed, with a reason
    (`SessionInfo.failure`): never trained, even if it holds a reward; its group is judged
    without it."""


@dataclass(frozen=True, slots=True)
class Run:
    id: str
    name: str
    config: JSON
    status: str
    created_at: datetime


@dataclass(frozen=True, slots=True)
class SessionInfo:
    id: str
    run_id: str
    group_id: str | None
    metadata: JSON
    status: SessionStatus
    created_at: datetime
    ended_at: datetime | None
    prefix_breaks: int
    """Requests that extended none of the session's segments and so began a new one."""
    train_state: TrainState
    outcome: Outcome | None = None
    """What the trainer made of it once settled (None before)."""
    consumed_step: int | None = None
    """The step that trained it (an outcome other than trained: -1); None before."""
    failure: str | None = None
    """Why its agent ended it as failed (outcome failed); None otherwise."""


@dataclass(frozen=True, slots=True)
class NewSession:
    info: SessionInfo
    api_key: str
    """The session's bearer key in plain text: returned once, stored only as a hash."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CompletionRecord:
    """One generated choice, committed before its response is sent.

    Invariants: `output_ids`, `logprobs` and `versions` share one length; `prompt_ids` is the full
    prompt the engine was given; its first `prefix_len` tokens are exactly the segment's tokens
    before this turn (0 when the turn opens a segment), so the store keeps only the rest.
    """

    id: str
    """`chatcmpl-...` or `cmpl-...`; with n > 1 each choice has its own id (`...-1`, `-2`)."""
    session_id: str
    segment_id: str
    segment_index: int
    """Position of the segment in its session (0, 1, ...)."""
    opens_segment: bool
    """True when this turn creates the segment (its row is inserted in the same transaction)."""
    prefix_break: bool
    """True when the request extended none of the session's segments: counted on the session,
    unless the turn is a side request's (`side`), which is a talk of its own."""
    transcript: JSON
    """The segment's transcript after this turn ({"messages": [...], "tools": [...]}): what the
    next request must start with to extend the segment."""
    prefix_len: int
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    status: TurnStatus = TurnStatus.OK
    replaces: str | None = None
    """The id of the segment's last turn that this one takes the place of (a retry of a request
    whose reply the client never received): that turn is marked replaced and the segment
    continues from before it, so `prefix_len` is that turn's own `prefix_len`."""
    side: str | None = None
    """The run's side request rule the request matched (`store.run_config`, side requests): the
    turn is recorded and never trained. None: the agent's own turn."""
    sampling: JSON = field(default_factory=dict)
    request: JSON = field(default_factory=dict)
    response: JSON = field(default_factory=dict)
    latency_ms: float = 0.0
    ttft_ms: float | None = None


@dataclass(frozen=True, slots=True)
class LastTurn:
    """The newest turn of a segment, as the gateway needs it to let a retry take its place.
    Invariant: `prefix_len <= prompt_len <= ` the segment's length."""

    completion_id: str
    status: TurnStatus
    """OK or ABORTED (a replaced turn is never a segment's last)."""
    prefix_len: int
    """The segment's length before this turn."""
    prompt_len: int
    """The length of this turn's whole prompt: the segment's tokens before its sampled ones."""
    request: JSON
    """The request body it answered."""


@dataclass(frozen=True, slots=True)
class KeptTurn:
    """One recorded turn as the protocols that chain on earlier responses read it back."""

    completion_id: str
    session_id: str
    status: TurnStatus
    request: JSON
    """The request body it answered (with the gateway's own part,
    `gateway.core.turn.RECORD_KEY`)."""
    response: JSON
    """Its response JSON, in its protocol."""


@dataclass(frozen=True, slots=True)
class SegmentState:
    """What the gateway needs to extend a segment: its transcript and its exact tokens."""

    id: str
    index: int
    transcript: JSON
    tokens: list[int]
    last_turn: LastTurn | None = None


@dataclass(frozen=True, slots=True)
class Segment:
    """One training sequence. Invariant: the four arrays share one length; `loss_mask` is 1
    exactly on sampled tokens, `logprobs` is 0 and `versions` -1 elsewhere."""

    id: str
    index: int
    tokens: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    completion_ids: list[str]
    turn_spans: list[tuple[int, int]]
    """Per completion, the half-open [start, end) range of its sampled tokens in `tokens`."""
    turn_sampling: list[JSON] = field(default_factory=list)
    """Per completion (aligned with `completion_ids`), the settings it was sampled with, as
    recorded (`CompletionRecord.sampling`: temperature, top_p, top_k, min_new_tokens, ... and the
    `contract`, see `store.run_config`); empty for a segment built without them."""
    turn_side: list[str | None] = field(default_factory=list)
    """Per completion (aligned with `completion_ids`), the side request rule that marked it
    (`CompletionRecord.side`), None for the agent's own turns; empty for a segment built without
    them. Only the session's detail shows side turns as turns: the trainer's view leaves them
    out (`store.trajectories`)."""


@dataclass(frozen=True, slots=True)
class Reward:
    value: float
    completion_id: str | None
    """None for an episode-level (final) reward."""
    key: str | None
    created_at: datetime
    late: bool = False
    """Recorded after the session was settled (`late_rewards: record`): exported, never
    trained."""


@dataclass(frozen=True, slots=True)
class SessionDetail:
    info: SessionInfo
    segments: list[Segment]
    rewards: list[Reward]
    returns: dict[str, float]
    """Per completion id (in turn order): G_i = r_i + gamma * G_{i+1}, where r_i sums the turn's
    own rewards and the final reward is added to the last turn."""
    finish_reasons: dict[str, str]


@dataclass(frozen=True, slots=True)
class Trajectory:
    """A finished, rewarded session as the trainer consumes it."""

    session: SessionInfo
    segments: list[Segment]
    returns: dict[str, float]
    reward: float
    """The episode's total reward (sum of all its rewards)."""
    min_version: int
    """The oldest policy version among its sampled tokens (-1 if it has none)."""
    aborted_turns: int = 0
    """Aborted turns left out of its segments (context at most, never trained)."""
    side_turns: int = 0
    """Side requests' turns left out of its segments (`store.run_config`, side requests)."""
    turn_rewards: dict[str, float] = field(default_factory=dict)
    """Per completion id (in turn order, as `returns`): r_i, the turn's own rewards, the final
    reward added to the last turn; `returns` discounts these."""
    finish_reasons: dict[str, str] = field(default_factory=dict)
    """Per completion id: why its sampling ended (`length`: `max_tokens` or the context cut it)."""


class RunStatus(enum.StrEnum):
    """What the operator set; the trainer obeys it between steps."""

    ACTIVE = "active"
    PAUSED = "paused"
    """No new training steps (agents may keep recording)."""
    STOPPED = "stopped"
    """Training is over: the trainer finishes, and no new sessions are created."""


@dataclass(frozen=True, slots=True)
class RunSummary:
    run: Run
    sessions: int
    active: int
    """Sessions not yet ended."""
    rewarded: int
    """Sessions holding at least one reward."""
    consumed: int
    """Sessions the trainer trained on."""
    last_step: int | None
    """The newest recorded training step, None before the first."""


@dataclass(frozen=True, slots=True)
class TrainStep:
    """One trainer step: the version it published, its metrics, where its checkpoint went."""

    run_id: str
    step: int
    version: int
    metrics: JSON
    checkpoint: str | None
    created_at: datetime


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionFilter:
    """Which sessions of a run to list or export (every bound inclusive; None: no bound)."""

    status: SessionStatus | None = None
    train_state: TrainState | None = None
    group_id: str | None = None
    min_reward: float | None = None
    """On the session's total reward; a bound excludes sessions without rewards."""
    max_reward: float | None = None
    rewarded: bool | None = None
    """True: only sessions with a reward; False: only those without."""
    min_version: int | None = None
    """Sessions with a sampled token whose policy version lies in [min_version, max_version]
    (checked per turn on its version range)."""
    max_version: int | None = None
    min_prefix_breaks: int | None = None
    max_prefix_breaks: int | None = None
    include_aborted: bool = False
    """Export aborted turns as turns (trained tokens, in `completion_ids`) rather than leaving
    them out (the default: their tokens stay only as context of a later turn)."""
    include_side: bool = False
    """Export side requests' turns (`store.run_config`) as turns rather than leaving them out
    (the default, as the trainer does)."""


@dataclass(frozen=True, slots=True)
class SessionSummary:
    """A row of the session browser."""

    info: SessionInfo
    turns: int
    reward: float | None
    """The sum of its rewards; None without any."""


@dataclass(frozen=True, slots=True)
class PublishedPolicy:
    """A policy version loaded into the gateway's engine, as recorded when it was loaded."""

    version: int
    path: str | None
    """The model directory its weights were loaded from (on the gateway's machine); None for
    weights handed over in process (`serve --train`), which no directory holds."""
    created_at: datetime
