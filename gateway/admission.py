"""Staleness admission (AReaL): a new session is admitted only while it cannot push training data
past the staleness bound eta.

    capacity = min(max_concurrent - running, (eta + v + 1) * B - (accepted + running))

with v the current policy version, B the trajectories per training step, `running` the run's
active sessions and `accepted` its ended, rewarded sessions the trainer did not drop. eta = 0 is
synchronous RL: one batch of sessions per policy version. A run whose config sets neither `eta`
nor `batch_size` is not throttled.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.errors import TooManyRequests
from store.run_config import run_config_of, throttled
from store.types import Run


def capacity(
    *,
    version: int,
    running: int,
    accepted: int,
    eta: int,
    batch_size: int,
    max_concurrent: int | None,
) -> int:
    stale_room = (eta + version + 1) * batch_size - (accepted + running)
    if max_concurrent is None:
        return stale_room
    return min(max_concurrent - running, stale_room)


def admitter(run: Run, count: int, version: int) -> Callable[[int, int], None] | None:
    """The check that admits `count` new sessions of `run` at policy `version`, given the run's
    (running, accepted) counts; None for a run that is not throttled. The store calls it in the
    transaction that creates the sessions, with the run locked (`Store.create_sessions`), so the
    bound holds however many gateways share the database."""
    if not throttled(run.config):
        return None
    cfg = run_config_of(run.config)

    def admit(running: int, accepted: int) -> None:
        room = capacity(
            version=version,
            running=running,
            accepted=accepted,
            eta=cfg.eta,
            batch_size=cfg.batch_size,
            max_concurrent=cfg.max_concurrent,
        )
        if count > room:
            raise TooManyRequests(
                f"run {run.id} is at its staleness bound (eta={cfg.eta}, policy version "
                f"{version}, {running} running, {accepted} finished, room for {max(room, 0)}): "
                "retry after the trainer publishes the next version",
                retry_after=1.0,
            )

    return admit
