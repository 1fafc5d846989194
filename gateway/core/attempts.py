"""One logical request, one turn: the attempts of retried requests, by key, in memory.

A client that times out or loses its connection retries, and each attempt would otherwise be a
turn of its own. A request names its logical request by an `Idempotency-Key` header; the openai
SDK sends none by default but marks every attempt with `x-stainless-retry-count` (0, 1, 2, ...),
so for it the key is a digest of the request's body, and attempt 0 always starts a new logical
request. Under one key (within one session):

- an attempt still running: a retry waits for it, then goes on as below;
- an attempt that answered: a retry gets the same response again (replayed);
- an attempt that did not answer (its client went away, or it failed): a retry runs anew. Its
  aborted turn is not trained (`store.trajectories`), and the new turn takes its place in the
  segment (`gateway.core.segments`).

The ledger lives in the gateway's memory (bounded, answered attempts kept `ttl_s`): after a
restart a retry runs anew, and the segment rules keep the session whole.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.errors import BadRequest

Key = tuple[str, ...]


@dataclass(eq=False, slots=True)
class _Attempt:
    fingerprint: str
    done: asyncio.Event = field(default_factory=asyncio.Event)
    response: dict[str, Any] | None = None
    """The answer; None until it answered, and for good when it did not."""
    ended_at: float | None = None

    def end(self, response: dict[str, Any] | None) -> None:
        self.response = response
        self.ended_at = time.monotonic()
        self.done.set()


class Attempts:
    def __init__(self, *, max_keys: int = 10_000, ttl_s: float = 900.0) -> None:
        self.max_keys = max_keys
        self.ttl_s = ttl_s
        self._by_key: OrderedDict[Key, _Attempt] = OrderedDict()

    async def once(
        self,
        key: Key,
        fingerprint: str,
        work: Callable[[bool], Awaitable[dict[str, Any]]],
        *,
        first: bool = False,
    ) -> tuple[dict[str, Any], bool]:
        """`work`'s response, or that of an earlier attempt under `key` (see the module
        docstring); True when replayed. `work(known)` is told whether an earlier attempt under
        the key is known here (if not, as after a restart, a retry may have to take the place of
        a turn whose reply was lost). `first`: this attempt says it is no retry (SDK attempt 0),
        so whatever ran before under the key is another logical request. BadRequest when the key
        was used for a request with another `fingerprint`."""
        known = False
        while not first:
            prev = self._by_key.get(key)
            if prev is None:
                break
            known = True
            if prev.fingerprint != fingerprint:
                raise BadRequest(
                    f"Idempotency-Key {key[-1]!r} was used for a different request: send a new "
                    "key with a new request",
                    param="Idempotency-Key",
                )
            if not prev.done.is_set():
                await prev.done.wait()
                continue
            if prev.response is not None:
                return prev.response, True
            break
        attempt = _Attempt(fingerprint)
        self._put(key, attempt)
        try:
            response = await work(known)
        except BaseException:
            attempt.end(None)
            raise
        attempt.end(response)
        return response, False

    def _put(self, key: Key, attempt: _Attempt) -> None:
        self._by_key[key] = attempt
        self._by_key.move_to_end(key)
        now = time.monotonic()
        # Oldest first: drop expired answers, and the oldest ended ones beyond `max_keys` (an
        # attempt still running is kept, so its retries can find it).
        while len(self._by_key) > 1:
            k, a = next(iter(self._by_key.items()))
            if a.ended_at is None or (
                now - a.ended_at <= self.ttl_s and len(self._by_key) <= self.max_keys
            ):
                return
            del self._by_key[k]
