"""Which segment a request extends (docs/architecture.md, "Contracts": multi-turn).

A session is a list of segments, each a token-exact training sequence with a transcript: the
messages (and tools) of its last request plus the reply the gateway produced. A request whose
messages start with a segment's transcript extends that segment (the most recent such segment);
anything else opens a new segment and counts as a prefix break. While one request extends a
segment, a second request matching it (parallel sub-calls) forks: it opens a new segment whose
prompt holds the shared prefix as context only, so no sampled token is ever trained twice.

A segment's last turn can be taken back when the client never received its reply: a request that
repeats the request of an aborted last turn (the client went away or timed out), or a retry (the
SDK's `x-stainless-retry-count` >= 1) that repeats the request of a completed last turn (committed
just before the gateway crashed, say), continues the segment from before that turn, which is
marked replaced. So a client's retry never forks its session into a prefix break, and a reply it
never saw is never trained.

The live state is kept per session in memory (bounded LRU) and rebuilt from the store on first use,
so a restarted gateway continues its sessions token for token; on a store that several gateways
share, it is rebuilt whenever another gateway recorded a turn of the session meanwhile, so any
gateway continues any session.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from store import Store
from store.types import LastTurn, TurnStatus

Transcript = dict[str, Any]


@dataclass(eq=False, slots=True)
class LiveSegment:
    id: str
    index: int
    transcript: Transcript | None
    """None while its first turn is in flight."""
    tokens: list[int]
    busy: bool = False
    last: LastTurn | None = None
    """Its newest turn (None while its first turn is in flight)."""

    def replaceable(self, *, retry: bool) -> LastTurn | None:
        """The last turn, if a request repeating its request may take its place: an aborted
        turn, or with `retry` (the client says it is retrying) a completed one too."""
        last = self.last
        if self.transcript is None or last is None:
            return None
        if last.status is TurnStatus.ABORTED or (retry and last.status is TurnStatus.OK):
            return last
        return None


@dataclass(slots=True)
class SessionState:
    segments: list[LiveSegment]
    turns: int = 0
    """The session's recorded turns this state holds (the store's `turn_count` when loaded, plus
    this gateway's commits since)."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def busy(self) -> bool:
        """A request of this gateway is in flight on one of its segments."""
        return any(s.busy for s in self.segments)

    def next_index(self) -> int:
        return max((s.index for s in self.segments), default=-1) + 1

    def open_segment(self, index: int | None = None) -> LiveSegment:
        if index is None:
            index = self.next_index()
        seg = LiveSegment(
            id=f"seg_{uuid.uuid4().hex[:24]}", index=index, transcript=None, tokens=[], busy=True
        )
        self.segments.append(seg)
        return seg

    def discard(self, seg: LiveSegment) -> None:
        if seg in self.segments:
            self.segments.remove(seg)


def chat_transcript(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]],
    template_kwargs: dict[str, Any] | None = None,
) -> Transcript:
    """What a chat turn was rendered from (the template's variables only when it had some)."""
    out: Transcript = {"kind": "chat", "messages": messages, "tools": tools}
    if template_kwargs:
        out["template_kwargs"] = template_kwargs
    return out


def same_message(recorded: dict[str, Any], sent: dict[str, Any]) -> bool:
    """A message the client sent is the recorded one: equal, or equal but for the reasoning a
    client may drop when it sends the history back (the segment keeps the exact tokens)."""
    if recorded == sent:
        return True
    if "reasoning_content" in sent or "reasoning_content" not in recorded:
        return False
    return {k: v for k, v in recorded.items() if k != "reasoning_content"} == sent


def _same(recorded: list[dict[str, Any]], sent: list[dict[str, Any]]) -> bool:
    return len(recorded) == len(sent) and all(map(same_message, recorded, sent))


def extends(
    transcript: Transcript | None,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]],
    template_kwargs: dict[str, Any] | None = None,
) -> bool:
    """The request's messages start with the transcript's, with the same tools and template
    variables."""
    if transcript is None or transcript.get("kind") != "chat":
        return False
    prior = transcript["messages"]
    return (
        transcript["tools"] == tools
        and transcript.get("template_kwargs", {}) == (template_kwargs or {})
        and len(prior) < len(messages)
        and _same(prior, messages[: len(prior)])
    )


def repeats(
    transcript: Transcript | None,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]],
    template_kwargs: dict[str, Any] | None = None,
) -> bool:
    """The request's messages, tools and template variables are those the transcript's last
    reply answered."""
    if transcript is None or transcript.get("kind") != "chat":
        return False
    prior: list[dict[str, Any]] = transcript["messages"]
    same_vars = transcript.get("template_kwargs", {}) == (template_kwargs or {})
    return bool(transcript["tools"] == tools and same_vars and _same(prior[:-1], messages))


def repeats_tokens(seg: LiveSegment, last: LastTurn, prompt_ids: list[int]) -> bool:
    """A completions request whose token prompt is exactly the prompt of the segment's last
    turn."""
    return (
        seg.transcript is not None
        and seg.transcript.get("kind") == "completion"
        and len(prompt_ids) == last.prompt_len
        and prompt_ids == seg.tokens[: last.prompt_len]
    )


def extends_tokens(seg: LiveSegment, prompt_ids: list[int]) -> bool:
    """A completions request whose token prompt starts with the segment's tokens."""
    n = len(seg.tokens)
    return (
        seg.transcript is not None
        and seg.transcript.get("kind") == "completion"
        and 0 < n < len(prompt_ids)
        and prompt_ids[:n] == seg.tokens
    )


class SegmentTracker:
    """Per-session live segment state, loaded lazily from the store, bounded by an LRU.

    On a store other gateways share (PostgreSQL), a turn may have been recorded by another one
    since this state was loaded: `refresh` compares the session's turn count and reloads."""

    def __init__(self, store: Store, *, max_sessions: int = 10_000) -> None:
        self.store = store
        self.max_sessions = max_sessions
        self._states: OrderedDict[str, SessionState] = OrderedDict()
        self._loading = asyncio.Lock()

    @property
    def shared(self) -> bool:
        """Other gateways may write the store (one gateway per SQLite file: `gateway/single.py`)."""
        return self.store.shared

    async def state(self, session_id: str) -> SessionState:
        state = self._states.get(session_id)
        if state is None:
            async with self._loading:
                state = self._states.get(session_id)
                if state is None:
                    state = SessionState([])
                    await self._load(session_id, state)
                    self._states[session_id] = state
                    self._evict()
        self._states.move_to_end(session_id)
        return state

    async def refresh(self, session_id: str, state: SessionState) -> None:
        """Under `state.lock`: reload the session's segments if another gateway recorded a turn
        since they were loaded (a shared store only; never while a request of this gateway is in
        flight on them, whose commit then finds the conflict: `Recorder.commit`)."""
        if not self.shared or state.busy():
            return
        turns = await self.store.session_turns(session_id)
        if turns != state.turns:
            await self._load(session_id, state, turns)

    async def _load(self, session_id: str, state: SessionState, turns: int | None = None) -> None:
        """The session's segments, and the turn count read before them (`turns`, when the caller
        just read it): a turn recorded in between makes the next `refresh` load again."""
        if turns is None:
            turns = await self.store.session_turns(session_id) if self.shared else 0
        rows = await self.store.load_segments(session_id)
        state.segments = [
            LiveSegment(r.id, r.index, r.transcript, list(r.tokens), last=r.last_turn) for r in rows
        ]
        state.turns = turns

    def register_empty(self, session_id: str) -> None:
        """A session this gateway just created: it has no segments to load."""
        self._states.setdefault(session_id, SessionState([]))
        self._evict()

    def forget(self, session_id: str) -> None:
        """A session deleted from the store: drop its state (a turn in flight fails to commit)."""
        self._states.pop(session_id, None)

    def _evict(self) -> None:
        while len(self._states) > self.max_sessions:
            for sid, st in self._states.items():
                if not st.lock.locked() and not any(s.busy for s in st.segments):
                    del self._states[sid]
                    break
            else:
                return
