"""Plans which segment each choice of a request lands in, and commits finished choices.

`plan` runs under the session's lock and reserves segments (marks them busy) so that concurrent
requests of one session fork instead of interleaving; `commit` writes every choice of a request in
one store transaction *before* the response is sent, then advances the live segments; `release`
undoes a plan whose request failed, leaving the session as it was.

Rendering and tokenizing a prompt run in a worker thread (a long message must not stall the other
sessions): the request is matched to a segment on the event loop, on comparisons only, and the
prompt is rendered from values taken at that moment.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.core.attempts import Attempts
from gateway.core.segments import LiveSegment, SegmentTracker, SessionState, Transcript
from store import Store
from store.errors import ConflictError
from store.types import CompletionRecord, LastTurn, TurnStatus


@dataclass(frozen=True, slots=True)
class Match:
    """The segment a request continues, and how its prompt is made."""

    segment: LiveSegment
    render: Callable[[], list[int] | None]
    """Runs in a worker thread, on values taken when matching (never on the live segment, which
    a commit may change meanwhile); None when the template cannot continue the segment (a fresh
    prompt then)."""
    replaces: LastTurn | None = None
    """The segment's last turn, which this request repeats and takes the place of."""


@dataclass(eq=False, slots=True)
class Target:
    """Where one choice is recorded."""

    segment: LiveSegment
    opens: bool
    prefix_len: int
    prefix_break: bool
    replaces: str | None = None


@dataclass(eq=False, slots=True)
class Plan:
    session_id: str
    state: SessionState
    prompt_ids: list[int]
    targets: list[Target]


@dataclass(frozen=True, slots=True)
class ChoiceOutcome:
    """A finished choice, ready to record."""

    completion_id: str
    transcript: Transcript
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    status: TurnStatus
    response: dict[str, Any]
    latency_ms: float
    ttft_ms: float | None


class Recorder:
    def __init__(
        self,
        store: Store,
        tracker: SegmentTracker,
        on_commit: Callable[[list[CompletionRecord]], None] | None = None,
    ) -> None:
        self.store = store
        self.tracker = tracker
        self.on_commit = on_commit
        """Told of every committed batch (the metrics count tokens and prefix breaks)."""
        self.attempts = Attempts()
        """Requests by idempotency key, so that a retried request yields one turn."""

    async def plan(
        self,
        session_id: str,
        n: int,
        choose: Callable[[list[LiveSegment]], Match | None],
        fresh_prompt: Callable[[], list[int]],
    ) -> Plan:
        """Reserve segments for `n` choices. `choose` picks the segment the request continues
        (most recent first), on the event loop; the prompt is then made in a worker thread, by
        the match's `render` or, when nothing matched (or the new messages' rendering cannot be
        told apart from the old, `ChatRenderer.continuation`), by `fresh_prompt`."""
        state = await self.tracker.state(session_id)
        async with state.lock:
            await self.tracker.refresh(session_id, state)
            match = choose([s for s in state.segments if s.transcript is not None])
            prompt: list[int] | None = None
            target: Target | None = None
            if match is not None:
                target = _reserve(state, match)
                try:
                    prompt = await asyncio.to_thread(match.render)
                except BaseException:
                    _undo(state, target)
                    raise
                if prompt is None:
                    _undo(state, target)
            if prompt is None:
                prompt = await asyncio.to_thread(fresh_prompt)
                had = any(s.transcript is not None for s in state.segments)
                target = Target(state.open_segment(), True, 0, had)
            assert target is not None
            targets = [target]
            for _ in range(n - 1):  # sibling choices branch into segments of their own
                targets.append(Target(state.open_segment(), True, 0, False))
            return Plan(session_id, state, prompt, targets)

    def release(self, plan: Plan) -> None:
        for t in plan.targets:
            _undo(plan.state, t)

    async def commit(
        self,
        plan: Plan,
        outcomes: list[ChoiceOutcome],
        sampling: dict[str, Any],
        request: dict[str, Any],
        *,
        side: str | None = None,
    ) -> None:
        """Write every choice in one transaction, then advance the live segments. On failure
        nothing is written and the plan is released. Completes even if the caller is cancelled
        (a client that went away): the turn is recorded all the same. `side`: the side request
        rule that marked the request (`store.run_config`)."""
        await asyncio.shield(self._commit(plan, outcomes, sampling, request, side))

    async def _commit(
        self,
        plan: Plan,
        outcomes: list[ChoiceOutcome],
        sampling: dict[str, Any],
        request: dict[str, Any],
        side: str | None,
    ) -> None:
        try:
            records = _records(plan, outcomes, sampling, request, side)
            try:
                await self.store.record_completions(records)
            except ConflictError:
                if not self.tracker.shared:
                    raise
                # Another gateway recorded a turn of this session meanwhile (its client sent two
                # requests at once, to two gateways): the choices become forks, as concurrent
                # requests to one gateway do (`_reserve`), and the state is reloaded.
                self.release(plan)
                plan = await self._as_forks(plan)
                records = _records(plan, outcomes, sampling, request, side)
                await self.store.record_completions(records)
        except BaseException:
            self.release(plan)
            raise
        for t, o in zip(plan.targets, outcomes, strict=True):
            t.segment.tokens = plan.prompt_ids + o.output_ids
            t.segment.transcript = o.transcript
            t.segment.last = LastTurn(
                o.completion_id, o.status, t.prefix_len, len(plan.prompt_ids), request
            )
            t.segment.busy = False
        plan.state.turns += len(records)
        if self.on_commit is not None:
            self.on_commit(records)

    async def _as_forks(self, plan: Plan) -> Plan:
        """`plan` with every choice in a segment of its own, opened after every segment the
        store holds (the prompt is context only: no sampled token is trained twice)."""
        state = plan.state
        async with state.lock:
            await self.tracker.refresh(plan.session_id, state)
            stored = await self.store.load_segments(plan.session_id)
            index = max([state.next_index(), *(row.index + 1 for row in stored)])
            targets = [
                Target(state.open_segment(index + i), True, 0, True)
                for i in range(len(plan.targets))
            ]
        return Plan(plan.session_id, state, plan.prompt_ids, targets)


def _records(
    plan: Plan,
    outcomes: list[ChoiceOutcome],
    sampling: dict[str, Any],
    request: dict[str, Any],
    side: str | None,
) -> list[CompletionRecord]:
    return [
        CompletionRecord(
            id=o.completion_id,
            session_id=plan.session_id,
            segment_id=t.segment.id,
            segment_index=t.segment.index,
            opens_segment=t.opens,
            prefix_break=t.prefix_break,
            transcript=o.transcript,
            prefix_len=t.prefix_len,
            prompt_ids=plan.prompt_ids,
            output_ids=o.output_ids,
            logprobs=o.logprobs,
            versions=o.versions,
            finish_reason=o.finish_reason,
            status=o.status,
            replaces=t.replaces,
            side=side,
            sampling=sampling,
            request=request,
            response=o.response,
            latency_ms=o.latency_ms,
            ttft_ms=o.ttft_ms,
        )
        for t, o in zip(plan.targets, outcomes, strict=True)
    ]


def _reserve(state: SessionState, match: Match) -> Target:
    seg = match.segment
    if seg.busy:  # a parallel call on the same history: fork, context only
        return Target(state.open_segment(), True, 0, True)
    seg.busy = True
    if match.replaces is not None:
        return Target(seg, False, match.replaces.prefix_len, False, match.replaces.completion_id)
    return Target(seg, False, len(seg.tokens), False)


def _undo(state: SessionState, target: Target) -> None:
    if target.opens:
        state.discard(target.segment)
    else:
        target.segment.busy = False
