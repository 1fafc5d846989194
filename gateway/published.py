"""The newest published policy, kept in the store so that a restarted gateway serves it again.

Every load of new weights into the gateway's engine is recorded (`Store.record_policy`):
`POST /admin/weights` records the directory it loaded, an in-process trainer (`serve --train`,
recorded by the composition layer) and a broadcast over the weight group (`POST
/admin/weights/broadcast`) record none, since those weights live only in the trainer's process,
its checkpoints and the servers (which keep serving them across a gateway restart). When the
gateway starts on its own engine, `restore_policy` loads the newest recorded policy at its
version before the server reports ready or admits any session, so agents never sample a base
model that the trainer has long left behind. Where that policy cannot be
loaded (in-process weights, a directory gone, weights that fail to load), it says in the log
what is served instead; a trainer that resumes republishes its checkpoint's version then.

Gateways that share a PostgreSQL database follow one another (`follow_policy`): a trainer
publishes to any one of them (through their load balancer), and every other one loads the newly
recorded policy within `policy_poll_seconds`; one that was down meanwhile loads it on start.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from engines.base import Engine, WeightUpdate
from engines.errors import WeightUpdateError
from store import Store

log = logging.getLogger(__name__)


async def follow_policy(engine: Engine, store: Store, every: float) -> None:
    """Every `every` seconds, load a policy newer than the engine's that another gateway
    recorded (`restore_policy`, each unloadable version said once in the log). Runs until
    cancelled; a store or engine error is logged and the next poll tries again."""
    told: set[int] = set()
    while True:
        await asyncio.sleep(every)
        try:
            newest = await store.latest_policy()
            if newest is None or newest.version <= engine.version() or newest.version in told:
                continue
            if await restore_policy(engine, store) < newest.version:
                told.add(newest.version)
        except asyncio.CancelledError:
            raise
        except Exception:  # the database or engine is down: the next poll tries again
            log.exception("could not follow the newest published policy")


async def restore_policy(engine: Engine, store: Store) -> int:
    """Load the store's newest published policy into `engine` when it is newer than what the
    engine serves and its directory exists; returns the version served afterwards."""
    newest = await store.latest_policy()
    served = engine.version()
    if newest is None or newest.version == served:
        return served
    if newest.version < served:
        log.info(
            "the model's weights are policy version %d, newer than the newest published one "
            "(%d): serving the model's",
            served,
            newest.version,
        )
        return served
    instead = (
        f"serving version {served} (the model's own weights) until a trainer publishes; "
        "a trainer resuming from its checkpoint publishes that version again"
    )
    if newest.path is None:
        log.warning(
            "the newest published policy, version %d, was handed over in process "
            "(serve --train) or over the weight group, and no directory holds it: %s",
            newest.version,
            instead,
        )
        return served
    path = Path(newest.path)
    if not await asyncio.to_thread(path.is_dir):
        log.warning(
            "the newest published policy, version %d, was loaded from %s, which no longer "
            "exists: %s",
            newest.version,
            path,
            instead,
        )
        return served
    try:
        version = await engine.update_weights(WeightUpdate(path=path, version=newest.version))
    except WeightUpdateError as exc:  # the base weights keep serving: start all the same
        log.error(
            "the newest published policy, version %d in %s, did not load (%s): %s",
            newest.version,
            path,
            exc,
            instead,
        )
        return served
    log.info("serving the newest published policy: version %d from %s", version, path)
    return version
