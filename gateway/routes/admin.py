"""Operator endpoints (admin token): the policy version, and loading new weights into the engine
(what a trainer in another process calls after each step)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, Field

from engines.base import WeightUpdate
from gateway.deps import GatewayDep
from gateway.errors import BadRequest
from gateway.routes.access import AdminDep

router = APIRouter(prefix="/admin", tags=["admin"])


class WeightsIn(BaseModel):
    path: str
    """A Hugging Face model directory with the new weights (safetensors)."""
    version: int | None = Field(None, ge=0)
    """The policy version these weights are; default current + 1."""


@router.get("/version")
async def version(gw: GatewayDep, _: AdminDep) -> dict[str, Any]:
    return {"version": gw.engine.version()}


@router.post("/weights")
async def load_weights(gw: GatewayDep, _: AdminDep, body: WeightsIn) -> dict[str, Any]:
    path = Path(body.path)
    if not await asyncio.to_thread(path.is_dir):
        raise BadRequest(f"{path} is not a directory on the gateway's machine", param="path")
    version = await gw.engine.update_weights(WeightUpdate(path=path, version=body.version))
    return {"version": version}
