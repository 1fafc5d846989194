"""The inference engine behind the gateway: health, load and the policy version it serves
(admin)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from gateway.deps import GatewayDep
from gateway.errors import error_docs
from gateway.routes.access import AdminDep

router = APIRouter(tags=["engines"], responses=error_docs(401, 403, 500))


@router.get("/engines")
async def engines(gw: GatewayDep, _: AdminDep) -> dict[str, Any]:
    """Each engine's state: `ok`, `paused`, `version`, and its load (`running` requests being
    decoded, `waiting` admitted but not started)."""
    h = await gw.engine.health()
    return {
        "engines": [
            {
                "name": type(gw.engine).__name__,
                "ok": h.ok,
                "paused": h.paused,
                "version": h.version,
                "running": h.running,
                "waiting": h.waiting,
                "load": h.running + h.waiting,
                "detail": h.detail,
            }
        ]
    }
