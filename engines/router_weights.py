"""The router's weights across its servers, apart from placement (`engines.router`).

- Updates are coordinated (`update`): every server is interrupted first (in-flight requests are
  paused; with `drain` they are let finish first), then each loads the weights, all under one
  version, then all resume. A server that fails its update is ejected (and re-synced once it
  can be); the update raises only when no server took it, and when every server refused the
  same weights (`WeightUpdateError`) the update is bad, not the servers: none is ejected.
- The weight group (`ranks`, `intact`, `join`) and its broadcasts (`_broadcast`), all or nothing.
- Re-sync (`resync`): a server that answers at another version than the fleet's is brought to the
  current weights from the last update applied (`current`: a path, or the state dict itself), with
  backoff after a failure, holding up no update of the others.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from engines.base import (
    Broadcast,
    Engine,
    ServerState,
    WeightGroup,
    WeightGroupMember,
    WeightUpdate,
)
from engines.errors import EngineUnavailableError, WeightUpdateError

log = logging.getLogger("engines.router")


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

    def eject(self, exc: BaseException) -> None:
        """Out of rotation, for `exc`: good probes re-admit it (a re-sync first if it lags)."""
        if self.healthy:
            log.warning("ejecting inference server %s: %s", self.name, exc)
        self.healthy = False
        self.goods = 0
        self.detail = str(exc)

    def state(self) -> ServerState:
        name = "up" if self.healthy else "stale" if self.lagging else "down"
        return ServerState(self.name, self.version, name, "" if self.healthy else self.detail)


class FleetWeights:
    """The weights of `backends`: the version they serve together, the last update applied, the
    weight group. `control` serialises updates, joins, and the router's pause and resume."""

    def __init__(
        self,
        backends: list[Backend],
        *,
        drain: bool,
        drained: Callable[[list[Backend]], Awaitable[None]],
        resync_timeout: float,
        resync_backoff_max: float,
        health_interval: float,
    ) -> None:
        self.backends = backends
        self.drain = drain
        self._drained = drained
        self.resync_timeout = resync_timeout
        self.resync_backoff_max = resync_backoff_max
        self.health_interval = health_interval
        self.version = max(b.version for b in backends)
        self.current: WeightUpdate | None = None
        """The last update applied, pinned to its version: what a lagging server is re-synced
        from (None before any: such a server waits for the next update)."""
        self.group: WeightGroup | None = None
        """The weight group the servers joined last (None: none, or a broadcast broke it)."""
        self.control = asyncio.Lock()

    async def update(self, update: WeightUpdate, *, paused: bool) -> int:
        """Interrupt (or drain) every healthy server unless the fleet is `paused`, load the
        weights into each under one version, resume them. Returns that version. A broadcast
        goes to every member of the weight group at once, all or nothing (`_broadcast`). The
        caller holds `control`."""
        version = update.version if update.version is not None else self.version + 1
        if version <= self.version:
            raise WeightUpdateError(
                f"version {version} is not newer than the current version {self.version}"
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
        if not paused:
            # a server that cannot even pause (it died since the last probe) is left out:
            # it misses this update and is re-synced once it answers again
            pauses = await asyncio.gather(
                *(b.engine.pause() for b in backends), return_exceptions=True
            )
            for b, r in zip(backends, pauses, strict=True):
                if isinstance(r, Exception):
                    b.eject(r)
            backends = [
                b for b, r in zip(backends, pauses, strict=True) if not isinstance(r, Exception)
            ]
            if not backends:
                raise EngineUnavailableError(
                    f"no inference server could be paused for the update: {pauses[0]}"
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
                b.eject(err)
        if not paused:
            await asyncio.gather(
                *(b.engine.resume() for b in backends if b.healthy), return_exceptions=True
            )
        if len(failed) == len(backends):
            raise WeightUpdateError(f"no server took the weights: {failed[0][1]}")
        self.version = version
        self.current = pinned
        for b in backends:
            b.version = b.engine.version()
            b.dirty = b.dirty and b in dict(failed)
        if failed:
            log.error("ejected %s: weight update failed", [b.name for b, _ in failed])
        return version

    async def ranks(self) -> int:
        """The ranks of every answering server (in rotation, or out for its version only)."""
        members = [b for b in self.backends if b.answering]
        ranks = await asyncio.gather(*(_ranks(b.engine) for b in members))
        return sum(ranks)

    def intact(self) -> bool:
        """Whether a broadcast can go now: a group was joined, every answering server is in it,
        and every member answers (a server restarted since has left it)."""
        if self.group is None:
            return False
        return all(b.in_group == b.answering for b in self.backends)

    async def join(self, group: WeightGroup, rank_offset: int = 1) -> None:
        """Every answering server joins `group`, ranks handed out in server order. All or
        nothing: one that cannot join fails the group (the trainer forms it again). The caller
        holds `control`."""
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
        self.group = None  # the servers leave the old group as they join the new one
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
        failed = [(b, r) for b, r in zip(members, joined, strict=True) if isinstance(r, Exception)]
        if failed:
            names = ", ".join(f"{b.name} ({r})" for b, r in failed)
            raise WeightUpdateError(f"the weight group was not formed: {names}")
        for b in members:
            b.in_group = True
        self.group = group

    async def _broadcast(self, broadcast: Broadcast, version: int) -> int:
        """Every member receives the same broadcast at once. All or nothing: if any member
        fails, the version stays, the group is gone, and every member is out until re-synced
        from the last update that holds its weights (a server that took only part of them
        serves mixed weights)."""
        if not self.intact():
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
            self.group = None
            for b in members:
                b.in_group = False
                b.dirty = True
                b.lagging = True
                b.eject(RuntimeError(f"a broadcast of version {version} failed"))
            names = ", ".join(f"{b.name} ({r})" for b, r in failed)
            raise WeightUpdateError(f"the broadcast of version {version} failed: {names}")
        self.version = version
        self.current = None  # a broadcast cannot be replayed: the next update re-syncs
        for b in members:
            b.version = b.engine.version()
            b.dirty = False
        return version

    async def resync(self, b: Backend) -> None:
        """Load the last update into `b` under the router's version; a failure backs off and
        leaves it out of rotation. Only `b` waits for it: updates of the others go on meanwhile
        (they leave `b` out), and if one lands, `b` is re-synced to it at the next probe."""
        if time.monotonic() < b.resync_at or b.syncing:
            return
        current, version = self.current, self.version
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
        if self.version != version:  # the others moved on meanwhile: again at the next probe
            return
        b.lagging = False
        b.dirty = False
        b.resync_delay = 0.0
        b.detail = "re-synced; re-admitted after good probes"
        log.info("re-synced inference server %s to version %d", b.name, b.version)


def _member(engine: Engine) -> WeightGroupMember:
    if not isinstance(engine, WeightGroupMember):
        raise WeightUpdateError(f"{type(engine).__name__} cannot join a weight group")
    return engine


async def _ranks(engine: Engine) -> int:
    return await _member(engine).weight_group_ranks()
