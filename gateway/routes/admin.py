"""Operator endpoints (admin token): the policy version, and loading new weights into the engine
(what a trainer in another process calls after each step)."""

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
    """The policy version these weights are, in [current + 1, `MAX_POLICY_VERSION`]; default
    current + 1."""


@router.get("/version")
async def version(gw: GatewayDep, _: AdminDep) -> dict[str, Any]:
    return {"version": gw.engine.version()}


@router.post("/weights", responses=error_docs(400, 409, 413, 422, 503))
async def load_weights(gw: GatewayDep, _: AdminDep, body: WeightsIn) -> dict[str, Any]:
    newest = gw.engine.version() + 1
    if body.version is not None and not newest <= body.version <= MAX_POLICY_VERSION:
        # the store records versions as int32: a larger one would fail every later turn
        raise BadRequest(
            f"version must be in [{newest}, {MAX_POLICY_VERSION}] (newer than the engine's "
            f"version {newest - 1}, and at most {MAX_POLICY_VERSION}), got {body.version}",
            param="version",
        )
    path = Path(body.path)
    if not await asyncio.to_thread(path.is_dir):
        raise BadRequest(f"{path} is not a directory on the gateway's machine", param="path")
    version = await gw.engine.update_weights(WeightUpdate(path=path, version=body.version))
    return {"version": version}
