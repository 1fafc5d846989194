"""Runs and their sessions (admin token)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from gateway.app import GatewayDep
from gateway.auth import require_admin
from gateway.errors import BadRequest

router = APIRouter(tags=["runs"])


class RunCreate(BaseModel):
    name: str = Field(min_length=1, max_length=200)
    config: dict[str, Any] = Field(default_factory=dict)


class SessionsCreate(BaseModel):
    count: int = Field(1, ge=1, le=1024)
    group_id: str | None = Field(None, max_length=200)
    """GRPO group: sessions that answer the same prompt share one group_id."""
    metadata: dict[str, Any] = Field(default_factory=dict)
    """Free data kept with each session (the task, its answer, ...)."""


def run_json(run: Any) -> dict[str, Any]:
    return {
        "id": run.id,
        "name": run.name,
        "config": run.config,
        "status": run.status,
        "created_at": run.created_at.isoformat(),
    }


@router.post("/runs", status_code=201)
async def create_run(gw: GatewayDep, request: Request, body: RunCreate) -> dict[str, Any]:
    require_admin(request, gw.settings.admin_token)
    validate_run_config(body.config)
    return run_json(await gw.store.create_run(body.name, body.config))


def validate_run_config(config: dict[str, Any]) -> None:
    """A run's config is a training config (`rlgateway train --config`), minus run and store."""
    from pydantic import ValidationError

    from trainer.config import TrainConfig

    try:
        TrainConfig.model_validate({**config, "run": "", "database_url": "sqlite:///x"})
    except (ValidationError, ValueError) as exc:
        if isinstance(exc, ValidationError):
            first = exc.errors()[0]
            where = ".".join(str(x) for x in first["loc"]) or "config"
            raise BadRequest(f"config.{where}: {first['msg']}", param="config") from None
        raise BadRequest(f"config: {exc}", param="config") from None


@router.get("/runs/{run_id}")
async def get_run(gw: GatewayDep, request: Request, run_id: str) -> dict[str, Any]:
    require_admin(request, gw.settings.admin_token)
    return run_json(await gw.store.get_run(run_id))


@router.post("/runs/{run_id}/sessions", status_code=201)
async def create_sessions(
    gw: GatewayDep, request: Request, run_id: str, body: SessionsCreate
) -> dict[str, Any]:
    require_admin(request, gw.settings.admin_token)
    run = await gw.store.get_run(run_id)
    async with gw.admission.lock(run_id):
        await gw.admission.check(run, body.count, gw.engine.version())
        created = await gw.store.create_sessions(
            run_id, body.count, group_id=body.group_id, metadata=body.metadata
        )
    for s in created:  # known to be empty: no need to load their segments later
        gw.sessions.remember_key(s.api_key, s.info)
        gw.recorder.tracker.register_empty(s.info.id)
    base = gw.settings.base_url()
    return {
        "sessions": [
            {
                "id": s.info.id,
                "run_id": s.info.run_id,
                "group_id": s.info.group_id,
                "base_url": f"{base}/sessions/{s.info.id}/v1",
                "api_key": s.api_key,
            }
            for s in created
        ]
    }
