"""Reading whole sessions back: token-exact segments, rewards and discounted returns.

Everything is loaded for many sessions at once (one query per table), so the trainer's batch of
trajectories costs four queries, not four per session.

Which turns a segment shows: a replaced turn (a retry took its place) is never part of it. An
aborted turn (its reply never reached the client whole) is a turn like any other in the session's
detail (`include_aborted`, what the page shows), but the trainer and the export leave it out: its
tokens stay as context (loss mask 0) when a later turn of the segment follows it, a segment's
trailing aborted turns are cut off, a segment left without turns is dropped, and it earns no
return (a reward given to it is ignored; the final reward goes to the last turn that remains).
A side request's turn (`completions.side`: a rule of the run marked its request, see
`store.run_config`) is shown in the detail, marked with its rule (`Segment.turn_side`), and left
out of the trainer's and the export's view in the same way (`include_side`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from store.arrays import decode_f32, decode_i32
from store.sessions import info_from_row
from store.tables import CompletionRow, RewardRow, SegmentRow, SessionRow
from store.types import JSON, Reward, Segment, SessionDetail, SessionInfo, Trajectory, TurnStatus


def check_gamma(gamma: float) -> None:
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must lie in [0, 1], got {gamma}")


def turn_rewards(turn_ids: Sequence[str], rewards: Sequence[Reward]) -> dict[str, float]:
    """r_i over the turns in order: the sum of the turn's own rewards, the final
    (completion-less) rewards counted on the last turn; rewards of turns not listed (left out,
    see the module docstring) count nowhere. Empty when there are no turns."""
    if not turn_ids:
        return {}
    r = dict.fromkeys(turn_ids, 0.0)
    for reward in rewards:
        turn = turn_ids[-1] if reward.completion_id is None else reward.completion_id
        if turn in r:
            r[turn] += reward.value
    return r


def discounted_returns(
    turn_ids: Sequence[str], rewards: Sequence[Reward], gamma: float
) -> dict[str, float]:
    """G_i = r_i + gamma * G_{i+1} over the turns in order, r_i as `turn_rewards` sums it."""
    return discounted(turn_rewards(turn_ids, rewards), gamma)


def discounted(r: dict[str, float], gamma: float) -> dict[str, float]:
    """G_i = r_i + gamma * G_{i+1} over `r`'s turns in order."""
    returns: dict[str, float] = {}
    g = 0.0
    for turn in reversed(r):
        g = r[turn] + gamma * g
        returns[turn] = g
    return {turn: returns[turn] for turn in r}


@dataclass(frozen=True, slots=True)
class Loaded:
    info: SessionInfo
    segments: list[Segment]
    rewards: list[Reward]
    turn_ids: list[str]
    """The session's completion ids in turn order (those its segments show)."""
    finish_reasons: dict[str, str]
    aborted_turns: int = 0
    """Aborted turns left out (0 when they are included)."""
    side_turns: int = 0
    """Side requests' turns left out (0 when they are included)."""

    def detail(self, gamma: float) -> SessionDetail:
        return SessionDetail(
            info=self.info,
            segments=self.segments,
            rewards=self.rewards,
            returns=discounted_returns(self.turn_ids, self.rewards, gamma),
            finish_reasons=self.finish_reasons,
        )

    def trajectory(self, gamma: float) -> Trajectory:
        """The session as the trainer takes it: late rewards (recorded after it was settled)
        are left out, they are for the export only."""
        rewards = [r for r in self.rewards if not r.late]
        versions = [
            v
            for seg in self.segments
            for v, m in zip(seg.versions, seg.loss_mask, strict=True)
            if m
        ]
        per_turn = turn_rewards(self.turn_ids, rewards)
        return Trajectory(
            session=self.info,
            segments=self.segments,
            returns=discounted(per_turn, gamma),
            reward=math.fsum(r.value for r in rewards),
            min_version=min(versions, default=-1),
            aborted_turns=self.aborted_turns,
            side_turns=self.side_turns,
            turn_rewards=per_turn,
            finish_reasons=self.finish_reasons,
        )


class _SegmentBuilder:
    def __init__(self, row: SegmentRow) -> None:
        self.row = row
        self.tokens: list[int] = []
        self.loss_mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.completion_ids: list[str] = []
        self.turn_spans: list[tuple[int, int]] = []
        self.turn_sampling: list[JSON] = []
        self.turn_side: list[str | None] = []
        self.shown_end = 0
        """Where the last shown turn ends (a left-out turn after it is cut off)."""

    def add(self, c: CompletionRow, *, shown: bool) -> None:
        """Append turn `c`: as a turn, or (not `shown`) as context tokens only."""
        delta, output = decode_i32(c.prompt_delta), decode_i32(c.output_ids)
        self.tokens += delta
        self.loss_mask += [0] * len(delta)
        self.logprobs += [0.0] * len(delta)
        self.versions += [-1] * len(delta)
        start = len(self.tokens)
        self.tokens += output
        if not shown:
            self.loss_mask += [0] * len(output)
            self.logprobs += [0.0] * len(output)
            self.versions += [-1] * len(output)
            return
        self.loss_mask += [1] * len(output)
        self.logprobs += decode_f32(c.logprobs)
        self.versions += decode_i32(c.versions)
        self.completion_ids.append(c.id)
        self.turn_spans.append((start, len(self.tokens)))
        self.turn_sampling.append(dict(c.sampling))
        self.turn_side.append(c.side)
        self.shown_end = len(self.tokens)

    def build(self) -> Segment:
        n = len(self.tokens)
        assert n == self.row.length, f"segment {self.row.id} holds {n} of {self.row.length}"
        assert len(self.loss_mask) == len(self.logprobs) == len(self.versions) == n
        end = self.shown_end
        return Segment(
            id=self.row.id,
            index=self.row.position,
            tokens=self.tokens[:end],
            loss_mask=self.loss_mask[:end],
            logprobs=self.logprobs[:end],
            versions=self.versions[:end],
            completion_ids=self.completion_ids,
            turn_spans=self.turn_spans,
            turn_sampling=self.turn_sampling,
            turn_side=self.turn_side,
        )


async def load_sessions(
    s: AsyncSession,
    session_ids: Sequence[str],
    *,
    include_aborted: bool = True,
    include_side: bool = True,
) -> dict[str, Loaded]:
    """Every found session of `session_ids`, keyed by id (missing ids are simply absent).
    Without `include_aborted` and `include_side` (the trainer's view; the export's by default)
    aborted turns and side requests' turns are left out (module docstring); replaced turns
    always are."""
    if not session_ids:
        return {}
    ids = list(session_ids)
    sessions = list(await s.scalars(select(SessionRow).where(SessionRow.id.in_(ids))))
    segment_rows = await s.scalars(
        select(SegmentRow).where(SegmentRow.session_id.in_(ids)).order_by(SegmentRow.position)
    )
    completions = await s.scalars(
        select(CompletionRow)
        .where(CompletionRow.session_id.in_(ids), CompletionRow.status != TurnStatus.REPLACED.value)
        .order_by(CompletionRow.turn)
    )
    reward_rows = await s.scalars(
        select(RewardRow).where(RewardRow.session_id.in_(ids)).order_by(RewardRow.id)
    )

    builders: dict[str, _SegmentBuilder] = {}
    by_session: dict[str, list[_SegmentBuilder]] = defaultdict(list)
    for seg in segment_rows:
        builders[seg.id] = _SegmentBuilder(seg)
        by_session[seg.session_id].append(builders[seg.id])
    turn_ids: dict[str, list[str]] = defaultdict(list)
    finish: dict[str, dict[str, str]] = defaultdict(dict)
    left_out: dict[str, int] = defaultdict(int)
    side: dict[str, int] = defaultdict(int)
    for c in completions:
        aborted = not include_aborted and c.status == TurnStatus.ABORTED.value
        marked = not include_side and c.side is not None
        builders[c.segment_id].add(c, shown=not (aborted or marked))
        if aborted:
            left_out[c.session_id] += 1
            continue
        if marked:
            side[c.session_id] += 1
            continue
        turn_ids[c.session_id].append(c.id)
        finish[c.session_id][c.id] = c.finish_reason
    rewards: dict[str, list[Reward]] = defaultdict(list)
    for rw in reward_rows:
        rewards[rw.session_id].append(
            Reward(
                value=rw.value,
                completion_id=rw.completion_id,
                key=rw.key,
                created_at=rw.created_at,
                late=rw.late,
            )
        )
    return {
        row.id: Loaded(
            info=info_from_row(row),
            segments=[b.build() for b in by_session[row.id] if b.completion_ids],
            rewards=rewards[row.id],
            turn_ids=turn_ids[row.id],
            finish_reasons=finish[row.id],
            aborted_turns=left_out[row.id],
            side_turns=side[row.id],
        )
        for row in sessions
    }
