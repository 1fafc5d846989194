"""`Router`: many engine servers behind one Engine.

- Placement: a request with a `session` key goes where that session went before (its prefix is
  in that server's cache) while that server is healthy; otherwise to the healthy server with the
  fewest outstanding requests (ours), ties broken by the server's own reported load.
- Health: a background loop probes each server every `health_interval` s. A server that fails
  `eject_after` probes in a row (or a request with a transport error) is ejected; it is
  re-admitted after `readmit_after` good probes at the router's version.
- Re-sync: a server that answers at another version than the router's (it missed an update
  while it was down or ejected, or it restarted on its own weights) is taken out of rotation at
  once, since its tokens would carry the wrong version, and brought to the current weights: the
  router keeps the last update it applied (a path, or the state dict itself: one copy of the
  weights held in this process until the next update) and loads it into the server under the
  router's version, holding up no update of the other servers meanwhile; good probes then
  re-admit it. A re-sync that fails is retried with backoff
  (up to `resync_backoff_max` s apart) and the server stays out (`stale`) meanwhile: only a
  server that cannot be brought to the current version is kept out. `health().servers` gives
  each server's version and state (`up`, `down`, `stale`), which the gateway's metrics export.
- Failures: a request whose server fails before producing any token is retried on another server
  (up to `retries` times); one whose server fails after producing tokens raises
  `EngineUnavailableError` (the gateway answers 503), since its tokens cannot be continued
  token-exactly elsewhere without the whole prefix, and the caller already has part of them.
- Weight updates are coordinated: every server is interrupted first (in-flight requests are
  paused; with `drain=True` they are let finish first), then each loads the weights, all under
  one version, then all resume. A server that fails its update is ejected (and re-synced once it
  can be); the update raises only when no server took it.

The session key is `GenerateRequest.request_id`'s prefix up to the first "/" when `session_of`
is not given, so the gateway can route by session without a protocol change.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

from engines.base import (
    Broadcast,
    Engine,
    EngineHealth,
    GenerateRequest,
    ServerState,
    TokenChunk,
    WeightGroup,
    WeightGroupMember,
    WeightUpdate,
)
from engines.errors import EngineUnavailableError, InvalidRequestError, WeightUpdateError

log = logging.getLogger(__name__)


def default_session_of(request: GenerateRequest) -> str | None:
    head, sep, _ = request.request_id.partition("/")
    return head if sep else None


@dataclass(eq=False, slots=True)
class Backend:
    """One server behind the router, with what the router knows about it."""

    name: str
    engine: Engine
    healthy: bool = True
    outstanding: int = 0
    reported_load: int = 0
    fails: int = 0
    goods: int = 0
    version: int = 0
    """The version the server last said it serves."""
    lagging: bool = False
    """It answers, at another version than the router's (out of rotation until re-synced)."""
    detail: str = ""
    """Why it is out of rotation."""
    resync_at: float = 0.0
    """`time.monotonic()` before which no re-sync is tried (backoff after a failed one)."""
    resync_delay: float = 0.0
    dirty: bool = False
    """A broadcast into it failed part-way: whatever its label says, its weights are mixed, and
    it stays out until re-synced."""
    in_group: bool = False
    """It joined the router's current weight group."""
    syncing: bool = False
    """A re-sync is loading weights into it now (updates meanwhile leave it out)."""

    @property
    def answering(self) -> bool:
        """In rotation, or out only for its version (its server answers)."""
        return self.healthy or self.lagging

    def state(self) -> ServerState:
        name = "up" if self.healthy else "stale" if self.lagging else "down"
        return ServerState(self.name, self.version, name, "" if self.healthy else self.detail)


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
        self.drain = drain
        self.resync_timeout = resync_timeout
        self.resync_backoff_max = resync_backoff_max
        self.session_of = session_of
        self.max_sessions = max_sessions
        self._affinity: dict[str, Backend] = {}
        self._where: dict[str, Backend] = {}  # live request id -> backend
        for b in self.backends:
            b.version = b.engine.version()
        self._version = max(b.version for b in self.backends)
        self._current: WeightUpdate | None = None
        """The last update applied, pinned to its version: what a lagging server is re-synced
        from (None before any: such a server waits for the next update)."""
        self._group: WeightGroup | None = None
        """The weight group the servers joined last (None: none, or a broadcast broke it)."""
        self._control = asyncio.Lock()
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
        return self._version

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
                self._mark_failed(current, exc)
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
        async with self._control:
            await self._on_each_up(lambda e: e.pause())
            self._paused = True

    async def resume(self) -> None:
        async with self._control:
            await self._on_each_up(lambda e: e.resume())
            self._paused = False

    async def _on_each_up(self, call: Callable[[Engine], Awaitable[None]]) -> None:
        """`call` on every server in rotation; one that fails is taken out (and re-synced when
        it answers again) instead of failing the others."""
        backends = self._up()
        results = await asyncio.gather(*(call(b.engine) for b in backends), return_exceptions=True)
        for b, r in zip(backends, results, strict=True):
            if isinstance(r, Exception):
                self._mark_failed(b, r)

    async def update_weights(self, update: WeightUpdate) -> int:
        """Interrupt (or drain) every healthy server, load the weights into each under one
        version, resume them all. Returns that version. A broadcast goes to every member of
        the weight group at once, all or nothing (`_broadcast`)."""
        async with self._control:
            version = update.version if update.version is not None else self._version + 1
            if version <= self._version:
                raise WeightUpdateError(
                    f"version {version} is not newer than the current version {self._version}"
                )
            if update.broadcast is not None:
                return await self._broadcast(update.broadcast, version)
            # a server out of rotation only for its version takes the update too: it is then
            # current, and good probes re-admit it (not one a re-sync is loading meanwhile)
            backends = [b for b in self.backends if b.answering and not b.syncing]
            if not backends:
                raise EngineUnavailableError("no healthy inference server to update")
            if self.drain:
                await self._drained(backends)
            if not self._paused:
                # a server that cannot even pause (it died since the last probe) is left out:
                # it misses this update and is re-synced once it answers again
                paused = await asyncio.gather(
                    *(b.engine.pause() for b in backends), return_exceptions=True
                )
                for b, r in zip(backends, paused, strict=True):
                    if isinstance(r, Exception):
                        self._mark_failed(b, r)
                backends = [
                    b for b, r in zip(backends, paused, strict=True) if not isinstance(r, Exception)
                ]
                if not backends:
                    raise EngineUnavailableError(
                        f"no inference server could be paused for the update: {paused[0]}"
                    )
            pinned = WeightUpdate(state_dict=update.state_dict, path=update.path, version=version)
            results = await asyncio.gather(
                *(b.engine.update_weights(pinned) for b in backends), return_exceptions=True
            )
            failed = [
                (b, r) for b, r in zip(backends, results, strict=True) if isinstance(r, Exception)
            ]
            refused = len(failed) == len(backends) and all(
                isinstance(err, WeightUpdateError) for _, err in failed
            )
            for b, err in failed:
                # every server refused the same weights: the update is bad, not the servers,
                # and each serves on at the old version (`WeightUpdateError`'s promise)
                if not refused:
                    self._mark_failed(b, err)
            if not self._paused:
                await asyncio.gather(
                    *(b.engine.resume() for b in backends if b.healthy), return_exceptions=True
                )
            if len(failed) == len(backends):
                raise WeightUpdateError(f"no server took the weights: {failed[0][1]}")
            self._version = version
            self._current = pinned
            for b in backends:
                b.version = b.engine.version()
                b.dirty = b.dirty and b in dict(failed)
            if failed:
                log.error("ejected %s: weight update failed", [b.name for b, _ in failed])
            return version

    # -- the weight group ---------------------------------------------------------------------

    async def weight_group_ranks(self) -> int:
        """The ranks of every answering server (in rotation, or out for its version only)."""
        members = [b for b in self.backends if b.answering]
        ranks = await asyncio.gather(*(_ranks(b.engine) for b in members))
        return sum(ranks)

    def weight_group_intact(self) -> bool:
        """Whether a broadcast can go now: a group was joined, every answering server is in it,
        and every member answers (a server restarted since has left it)."""
        if self._group is None:
            return False
        return all(b.in_group == b.answering for b in self.backends)

    async def join_weight_group(self, group: WeightGroup, rank_offset: int = 1) -> None:
        """Every answering server joins `group`, ranks handed out in server order. All or
        nothing: one that cannot join fails the group (the trainer forms it again)."""
        async with self._control:
            members = [b for b in self.backends if b.answering]
            if not members:
                raise EngineUnavailableError("no inference server answers: none can join")
            ranks = await asyncio.gather(*(_ranks(b.engine) for b in members))
            if rank_offset + sum(ranks) != group.world_size:  # refused: the group stays
                raise WeightUpdateError(
                    f"the weight group has {group.world_size} ranks, but the trainer's "
                    f"{rank_offset} and the servers' {sum(ranks)} make "
                    f"{rank_offset + sum(ranks)}: ask for the group's size again"
                )
            self._group = None  # the servers leave the old group as they join the new one
            for b in self.backends:
                b.in_group = False
            offsets = [rank_offset + sum(ranks[:i]) for i in range(len(members))]
            joined = await asyncio.gather(
                *(
                    _member(b.engine).join_weight_group(group, offset)
                    for b, offset in zip(members, offsets, strict=True)
                ),
                return_exceptions=True,
            )
            failed = [
                (b, r) for b, r in zip(members, joined, strict=True) if isinstance(r, Exception)
            ]
            if failed:
                names = ", ".join(f"{b.name} ({r})" for b, r in failed)
                raise WeightUpdateError(f"the weight group was not formed: {names}")
            for b in members:
                b.in_group = True
            self._group = group

    async def _broadcast(self, broadcast: Broadcast, version: int) -> int:
        """Every member receives the same broadcast at once. All or nothing: if any member
        fails, the version stays, the group is gone, and every member is out until re-synced
        from the last update that holds its weights (a server that took only part of them
        serves mixed weights)."""
        if not self.weight_group_intact():
            outside = [b.name for b in self.backends if b.answering and not b.in_group]
            gone = [b.name for b in self.backends if b.in_group and not b.answering]
            raise WeightUpdateError(
                "the weight group must be formed again before a broadcast"
                + (f": {outside} answer outside it" if outside else "")
                + (f": {gone} left it" if gone else "")
            )
        members = [b for b in self.backends if b.in_group]
        syncing = [b.name for b in members if b.syncing]
        if syncing:
            raise WeightUpdateError(f"{syncing} of the weight group are being re-synced")
        if self.drain:
            await self._drained([b for b in members if b.healthy])
        results = await asyncio.gather(
            *(
                b.engine.update_weights(WeightUpdate(broadcast=broadcast, version=version))
                for b in members
            ),
            return_exceptions=True,
        )
        failed = [(b, r) for b, r in zip(members, results, strict=True) if isinstance(r, Exception)]
        if failed:
            self._group = None
            for b in members:
                b.in_group = False
                b.dirty = True
                b.lagging = True
                self._mark_failed(b, RuntimeError(f"a broadcast of version {version} failed"))
            names = ", ".join(f"{b.name} ({r})" for b, r in failed)
            raise WeightUpdateError(f"the broadcast of version {version} failed: {names}")
        self._version = version
        self._current = None  # a broadcast cannot be replayed: the next update re-syncs
        for b in members:
            b.version = b.engine.version()
            b.dirty = False
        return version

    async def _drained(self, backends: list[Backend], drain_s: float = 300) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(drain_s), self._idle:
                await self._idle.wait_for(lambda: not any(b.outstanding for b in backends))

    def _up(self) -> list[Backend]:
        return [b for b in self.backends if b.healthy]

    # -- health -------------------------------------------------------------------------------

    def _mark_failed(self, backend: Backend, exc: BaseException) -> None:
        if backend.healthy:
            log.warning("ejecting inference server %s: %s", backend.name, exc)
        backend.healthy = False
        backend.goods = 0
        backend.detail = str(exc)

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
            b.lagging = answering and (b.version != self._version or b.dirty)
            if b.lagging:
                b.fails = 0
                why = (
                    "took part of a failed broadcast"
                    if b.dirty
                    else (f"serves version {b.version}, not {self._version}")
                )
                self._mark_failed(b, RuntimeError(why))
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
                    self._mark_failed(b, RuntimeError(f"health: {h}"))
        if lagging:
            await asyncio.gather(*(self._resync(b) for b in lagging))

    async def _resync(self, b: Backend) -> None:
        """Load the last update into `b` under the router's version; a failure backs off and
        leaves it out of rotation. Only `b` waits for it: updates of the others go on meanwhile
        (they leave `b` out), and if one lands, `b` is re-synced to it at the next probe."""
        if time.monotonic() < b.resync_at or b.syncing:
            return
        current, version = self._current, self._version
        if current is None:
            b.detail = (
                f"serves version {b.version}, not {version}, and no update since this router "
                "started holds the weights to re-sync it: the next update reaches it"
            )
            return
        if b.engine.version() == version and not b.dirty:  # an update reached it
            return
        b.syncing = True
        try:
            async with asyncio.timeout(self.resync_timeout):
                await b.engine.update_weights(current)
        except Exception as exc:  # a server that cannot take the weights stays out
            b.resync_delay = min(
                max(2 * b.resync_delay, self.health_interval), self.resync_backoff_max
            )
            b.resync_at = time.monotonic() + b.resync_delay
            b.detail = f"re-sync to version {version} failed: {exc}"
            log.error(
                "inference server %s cannot be brought to version %d (%s); retrying in %.0f s",
                b.name,
                version,
                exc,
                b.resync_delay,
            )
            return
        finally:
            b.syncing = False
        b.version = b.engine.version()
        if self._version != version:  # the others moved on meanwhile: again at the next probe
            return
        b.lagging = False
        b.dirty = False
        b.resync_delay = 0.0
        b.detail = "re-synced; re-admitted after good probes"
        log.info("re-synced inference server %s to version %d", b.name, b.version)

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
            version=self._version,
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


def _member(engine: Engine) -> WeightGroupMember:
    if not isinstance(engine, WeightGroupMember):
        raise WeightUpdateError(f"{type(engine).__name__} cannot join a weight group")
    return engine


async def _ranks(engine: Engine) -> int:
    return await _member(engine).weight_group_ranks()
