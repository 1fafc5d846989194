"""`Router`: many engine servers behind one Engine.

- Placement: a request with a `session` key goes where that session went before (its prefix is
  in that server's cache) while that server is healthy; otherwise to the healthy server with the
  fewest outstanding requests (ours), ties broken by the server's own reported load.
- Health: a background loop probes each server every `health_interval` s. A server that fails
  `eject_after` probes in a row (or a request with a transport error) is ejected; it is
  re-admitted after `readmit_after` good probes at the router's version.
- Re-sync: a server that answers at another version than the router's (it missed an update
  while it was down or ejected, or it restarted on its own weights) is taken out of rotation at
  once, since its tokens would carry the wrong version, and brought to the current weights
  (`engines.router_weights.FleetWeights.resync`, holding up no update of the other servers);
  good probes then re-admit it. A re-sync that fails is retried with backoff (up to
  `resync_backoff_max` s apart) and the server stays out (`stale`) meanwhile. `health().servers`
  gives each server's version and state (`up`, `down`, `stale`), which the gateway's metrics
  export.
- Failures: a request whose server fails before producing any token is retried on another server
  (up to `retries` times); one whose server fails after producing tokens raises
  `EngineUnavailableError` (the gateway answers 503), since its tokens cannot be continued
  token-exactly elsewhere without the whole prefix, and the caller already has part of them.
- Weights: updates, the weight group and its broadcasts, and re-sync are `router.weights`
  (`engines.router_weights`): every server is interrupted, loads the weights under one version,
  and resumes; pause and resume wait for an update in progress.

The session key is `GenerateRequest.request_id`'s prefix up to the first "/" when `session_of`
is not given, so the gateway can route by session without a protocol change.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from engines.base import (
    Engine,
    EngineHealth,
    GenerateRequest,
    TokenChunk,
    WeightGroup,
    WeightUpdate,
)
from engines.errors import EngineUnavailableError, InvalidRequestError
from engines.router_weights import Backend, FleetWeights

log = logging.getLogger(__name__)


def default_session_of(request: GenerateRequest) -> str | None:
    head, sep, _ = request.request_id.partition("/")
    return head if sep else None


class Router:
    """Implements `engines.base.Engine` over several engines (usually HTTP adapters)."""

    def __init__(
        self,
        engines: Sequence[tuple[str, Engine]],
        *,
        health_interval: float = 2.0,
        eject_after: int = 2,
        readmit_after: int = 2,
        retries: int = 2,
        drain: bool = False,
        resync_timeout: float = 600.0,
        resync_backoff_max: float = 60.0,
        session_of: Callable[[GenerateRequest], str | None] = default_session_of,
        max_sessions: int = 100_000,
    ) -> None:
        if not engines:
            raise ValueError("a router needs at least one engine")
        self.backends = [Backend(name, engine) for name, engine in engines]
        self.health_interval = health_interval
        self.eject_after = eject_after
        self.readmit_after = readmit_after
        self.retries = retries
        self.session_of = session_of
        self.max_sessions = max_sessions
        self._affinity: dict[str, Backend] = {}
        self._where: dict[str, Backend] = {}  # live request id -> backend
        for b in self.backends:
            b.version = b.engine.version()
        self.weights = FleetWeights(
            self.backends,
            drain=drain,
            drained=self._drained,
            resync_timeout=resync_timeout,
            resync_backoff_max=resync_backoff_max,
            health_interval=health_interval,
        )
        self._idle = asyncio.Condition()  # notified whenever a request leaves a backend
        self._paused = False
        self._probe_task: asyncio.Task[None] | None = None
        self._closed = False

    def start(self) -> None:
        """Start the background health checks (needs a running event loop)."""
        if self._probe_task is None:
            self._probe_task = asyncio.create_task(self._probe_loop(), name="router-health")

    # -- placement ----------------------------------------------------------------------------

    def pick(self, request: GenerateRequest, exclude: frozenset[int] = frozenset()) -> Backend:
        candidates = [b for i, b in enumerate(self.backends) if b.healthy and i not in exclude]
        if not candidates:
            raise EngineUnavailableError(
                "no healthy inference server: all are down or ejected; retry later"
            )
        session = self.session_of(request)
        if session is not None:
            chosen = self._affinity.get(session)
            if chosen is not None and chosen in candidates:
                return chosen
        best = min(candidates, key=lambda b: (b.outstanding, b.reported_load))
        if session is not None:
            if len(self._affinity) >= self.max_sessions:
                self._affinity.pop(next(iter(self._affinity)))
            self._affinity[session] = best
        return best

    # -- the Engine protocol ------------------------------------------------------------------

    def version(self) -> int:
        return self.weights.version

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        request.validate()
        if self._closed:
            raise EngineUnavailableError("the router is closed")
        self._check_not_live(request.request_id)
        backend = self.pick(request)
        first = backend.engine.generate(request)  # raises InvalidRequestError here
        return self._stream(request, backend, first)

    async def _stream(
        self, request: GenerateRequest, backend: Backend, stream: AsyncIterator[TokenChunk]
    ) -> AsyncIterator[TokenChunk]:
        # checked again here, where it is registered: a stream never iterated leaves nothing
        self._check_not_live(request.request_id)
        tried = {self.backends.index(backend)}
        while True:
            produced = False
            current = backend
            current.outstanding += 1
            self._where[request.request_id] = current
            try:
                async with contextlib.aclosing(stream) as chunks:  # type: ignore[type-var]
                    async for chunk in chunks:
                        produced = produced or bool(chunk.token_ids)
                        yield chunk
                return
            except EngineUnavailableError as exc:
                current.eject(exc)
                if produced:
                    raise EngineUnavailableError(
                        f"inference server {current.name} failed mid-generation of "
                        f"{request.request_id}: {exc}; send the request again"
                    ) from exc
                if len(tried) > self.retries:
                    raise
                backend = self.pick(request, exclude=frozenset(tried))
                tried.add(self.backends.index(backend))
                log.warning("retrying %s on %s", request.request_id, backend.name)
                stream = backend.engine.generate(request)
            finally:
                current.outstanding -= 1
                self._where.pop(request.request_id, None)
                async with self._idle:
                    self._idle.notify_all()

    def _check_not_live(self, request_id: str) -> None:
        """Ids are unique among live requests across the servers, not only on one: a second
        request under a live id would take the first one's place in `_where` (its aborts)."""
        if request_id in self._where:
            raise InvalidRequestError(f"request id {request_id!r} is already live")

    async def abort(self, request_id: str) -> None:
        backend = self._where.get(request_id)
        if backend is not None:
            await backend.engine.abort(request_id)

    async def pause(self) -> None:
        async with self.weights.control:
            await self._on_each_up(lambda e: e.pause())
            self._paused = True

    async def resume(self) -> None:
        async with self.weights.control:
            await self._on_each_up(lambda e: e.resume())
            self._paused = False

    async def _on_each_up(self, call: Callable[[Engine], Awaitable[None]]) -> None:
        """`call` on every server in rotation; one that fails is taken out (and re-synced when
        it answers again) instead of failing the others."""
        backends = self._up()
        results = await asyncio.gather(*(call(b.engine) for b in backends), return_exceptions=True)
        for b, r in zip(backends, results, strict=True):
            if isinstance(r, Exception):
                b.eject(r)

    async def update_weights(self, update: WeightUpdate) -> int:
        """Every server's weights, under one version (`engines.router_weights`)."""
        async with self.weights.control:
            return await self.weights.update(update, paused=self._paused)

    # -- the weight group ---------------------------------------------------------------------

    async def weight_group_ranks(self) -> int:
        return await self.weights.ranks()

    def weight_group_intact(self) -> bool:
        return self.weights.intact()

    async def join_weight_group(self, group: WeightGroup, rank_offset: int = 1) -> None:
        async with self.weights.control:
            await self.weights.join(group, rank_offset)

    async def _drained(self, backends: list[Backend], drain_s: float = 300) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(drain_s), self._idle:
                await self._idle.wait_for(lambda: not any(b.outstanding for b in backends))

    def _up(self) -> list[Backend]:
        return [b for b in self.backends if b.healthy]

    # -- health -------------------------------------------------------------------------------

    async def check(self) -> None:
        """One round of health probes: eject after `eject_after` failures, re-admit after
        `readmit_after` successes at the router's version; take a server that answers at
        another version out at once and re-sync it (module docstring)."""
        healths = await asyncio.gather(
            *(b.engine.health() for b in self.backends), return_exceptions=True
        )
        lagging = []
        for b, h in zip(self.backends, healths, strict=True):
            answering = isinstance(h, EngineHealth) and h.ok
            if isinstance(h, EngineHealth):
                b.reported_load = h.running + h.waiting
                b.version = h.version
            b.lagging = answering and (b.version != self.weights.version or b.dirty)
            if b.lagging:
                b.fails = 0
                why = (
                    "took part of a failed broadcast"
                    if b.dirty
                    else (f"serves version {b.version}, not {self.weights.version}")
                )
                b.eject(RuntimeError(why))
                lagging.append(b)
            elif answering:
                b.fails = 0
                b.goods += 1
                # not while the fleet is paused: a re-admitted server has not been paused
                if not b.healthy and b.goods >= self.readmit_after and not self._paused:
                    log.info("re-admitting inference server %s at version %d", b.name, b.version)
                    b.healthy = True
                    b.detail = ""
            else:
                b.goods = 0
                b.fails += 1
                if b.fails >= self.eject_after:
                    b.eject(RuntimeError(f"health: {h}"))
        if lagging:
            await asyncio.gather(*(self.weights.resync(b) for b in lagging))

    async def _probe_loop(self) -> None:
        while not self._closed:
            try:
                await self.check()
            except Exception:  # the loop must outlive a bad probe
                log.exception("router health check failed")
            await asyncio.sleep(self.health_interval)

    async def health(self) -> EngineHealth:
        healths = await asyncio.gather(
            *(b.engine.health() for b in self.backends), return_exceptions=True
        )
        good = [h for h in healths if isinstance(h, EngineHealth) and h.ok]
        up = sum(b.healthy for b in self.backends)
        return EngineHealth(
            ok=up > 0 and not self._closed,
            paused=self._paused,
            version=self.weights.version,
            running=sum(h.running for h in good),
            waiting=sum(h.waiting for h in good),
            detail=", ".join(f"{b.name}:{b.state().state}" for b in self.backends),
            servers=tuple(b.state() for b in self.backends),
        )

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._probe_task is not None:
            self._probe_task.cancel()
            await asyncio.gather(self._probe_task, return_exceptions=True)
        await asyncio.gather(*(b.engine.close() for b in self.backends), return_exceptions=True)
