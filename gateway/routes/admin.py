"""Operator endpoints (admin token): the policy version, and loading new weights into the engine
(what a trainer in another process calls after each step). Each load is recorded as the newest
published policy, which a restarted gateway serves again (`gateway.published`)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from fastapi import APIRouter

from engines.base import WeightUpdate
from engines.limits import MAX_POLICY_VERSION
from gateway.deps import GatewayDep
from gateway.errors import BadRequest, error_docs
from gateway.limits import CheckedBody
from gateway.routes.access import AdminDep

router = APIRouter(prefix="/admin", tags=["admin"], responses=error_docs(401, 403, 500))


class WeightsIn(CheckedBody):
    path: str
    """A Hugging Face model directory with the new weights (safetensors)."""
    version: int | None = None
    """The policy version these weights are, in [current + 1, `MAX_POLICY_VERSION`], or the
    current version itself (a no-op: a restarted trainer publishing what is served already);
    default current + 1."""


@router.get("/version")
async def version(gw: GatewayDep, _: AdminDep) -> dict[str, Any]:
    return {"version": gw.engine.version()}


@router.post("/weights", responses=error_docs(400, 409, 413, 422, 503))
async def load_weights(gw: GatewayDep, _: AdminDep, body: WeightsIn) -> dict[str, Any]:
    """Load the weights in `path` as policy `version` and record them as the newest published
    policy (a restarted gateway serves it again). `changed` is false when `version` is the one
    served already: nothing is loaded."""
    served = gw.engine.version()
    if body.version == served:
        return {"version": served, "changed": False}
    newest = served + 1
    if body.version is not None and not newest <= body.version <= MAX_POLICY_VERSION:
        # the store records versions as int32: a larger one would fail every later turn
        raise BadRequest(
            f"version must be in [{newest}, {MAX_POLICY_VERSION}] (newer than the engine's "
            f"version {served}, and at most {MAX_POLICY_VERSION}), or {served} itself (a "
            f"no-op), got {body.version}",
            param="version",
        )
    path = await asyncio.to_thread(_model_dir, Path(body.path))
    version = await gw.engine.update_weights(WeightUpdate(path=path, version=body.version))
    await gw.store.record_policy(version, str(path))
    return {"version": version, "changed": True}


def _model_dir(path: Path) -> Path:
    """`path` made absolute (a restarted gateway may run elsewhere); BadRequest unless it is a
    directory."""
    if not path.is_dir():
        raise BadRequest(f"{path} is not a directory on the gateway's machine", param="path")
    return path.resolve()
