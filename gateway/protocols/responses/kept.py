"""The responses the gateway keeps for `previous_response_id` and `GET /v1/responses/{id}`.

A kept response is its conversation (the neutral messages through its output, without its
`instructions`, which OpenAI does not carry over a chain), the call ids its output leaves open,
and its response JSON. Responses are kept in memory (a bounded LRU); a session's responses are
also its recorded turns, so after a restart (or an eviction) one is rebuilt from the store: its
recorded request and response, and recursively the one it chained on. A response sent with
`store: false` is never kept, nor read back.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from gateway.core.chat_render import Message
from gateway.core.turn_types import RECORD_KEY
from gateway.protocols.responses.types import input_messages
from store import Store
from store.types import JSON, KeptTurn, TurnStatus


@dataclass(frozen=True, slots=True)
class KeptResponse:
    id: str
    session_id: str | None
    """The session it was recorded into (None: an unrecorded call, kept in memory only)."""
    conversation: list[Message]
    open_calls: frozenset[str]
    """The call ids of its function calls, which the next input's outputs answer."""
    response: JSON


def conversation_of(
    prior: list[Message], open_calls: frozenset[str], items: Any, output: list[JSON]
) -> list[Message]:
    """The conversation after a response: what came before (leaving `open_calls` for its input
    to answer), its input items, its output. A media part among its input items was accepted
    (the run renders them as placeholders, or it would have been refused): it renders so again."""
    given = input_messages(items, open_calls=open_calls, media="placeholder")
    return [*prior, *given, *input_messages(output)]


def open_calls_of(output: list[JSON]) -> frozenset[str]:
    return frozenset(str(i["call_id"]) for i in output if i.get("type") == "function_call")


class KeptResponses:
    def __init__(self, store: Store, max_entries: int = 10_000) -> None:
        self.store = store
        self.max_entries = max_entries
        self._kept: OrderedDict[str, KeptResponse] = OrderedDict()

    def keep(self, kept: KeptResponse) -> None:
        self._kept[kept.id] = kept
        self._kept.move_to_end(kept.id)
        while len(self._kept) > self.max_entries:
            self._kept.popitem(last=False)

    async def get(self, response_id: str, session_id: str | None) -> KeptResponse | None:
        """The kept response of this id that `session_id`'s caller may see (None: the admin,
        who sees every one), or None."""
        kept = self._kept.get(response_id) or await self._rebuild(response_id)
        if kept is None or (session_id is not None and kept.session_id != session_id):
            return None
        self._kept.move_to_end(kept.id)
        return kept

    async def _rebuild(self, response_id: str) -> KeptResponse | None:
        """Read a chain back from the store, from `response_id` to the newest response of it
        still in memory (or its start), then rebuild it forwards."""
        chain: list[KeptTurn] = []
        base: KeptResponse | None = None
        next_id: str | None = response_id
        while next_id is not None:
            turn = await self.store.get_turn(next_id)
            if turn is None or not _kept_turn(turn):
                return None
            chain.append(turn)
            previous = turn.request.get("previous_response_id")
            next_id = previous if isinstance(previous, str) else None
            if next_id is not None and (base := self._kept.get(next_id)) is not None:
                break
        for turn in reversed(chain):
            output = turn.response.get("output", [])
            prior = [] if base is None else base.conversation
            calls = frozenset() if base is None else base.open_calls
            base = KeptResponse(
                id=turn.completion_id,
                session_id=turn.session_id,
                conversation=conversation_of(prior, calls, turn.request.get("input", []), output),
                open_calls=open_calls_of(output),
                response=turn.response,
            )
            self.keep(base)
        return base


def _kept_turn(turn: KeptTurn) -> bool:
    """A completed turn of the Responses API, sent with `store` (the default)."""
    own = turn.request.get(RECORD_KEY)
    return (
        turn.status is TurnStatus.OK
        and isinstance(own, dict)
        and own.get("protocol") == "responses"
        and turn.request.get("store", True) is not False
    )
