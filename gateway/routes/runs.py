"""Runs: create (admin), list (admin), read (admin or the run's key), pause / resume / stop and
delete (admin), and replace the run's agent key (admin).

A run's status is what its trainer obeys between steps (`rlgateway serve --train` or a separate
`rlgateway train`): `paused` starts no new step, `stopped` ends training for good (and refuses new
sessions).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import Field

from gateway.deps import GatewayDep
from gateway.errors import BadRequest, Conflict, error_docs
from gateway.limits import CheckedBody
from gateway.routes.access import AdminDep, RunAdminDep, RunAgentDep
from gateway.views import run_json, run_summary_json
from store.types import RunStatus

router = APIRouter(tags=["runs"], responses=error_docs(401, 403, 500))
_RUN = error_docs(404, 422)
"""What every route on one run (`{run_id}`) adds."""
_STATUS = error_docs(404, 409, 422)
"""What pause, resume and stop add: 409 for a run stopped for good."""


class RunCreate(CheckedBody):
    name: str = Field(min_length=1, max_length=200)
    config: dict[str, Any] = Field(default_factory=dict)
    """A training config (the keys of `rlgateway train --config`, minus `run` and the store)."""


@router.post("/runs", status_code=201, responses=error_docs(400, 413, 422))
async def create_run(gw: GatewayDep, _: AdminDep, body: RunCreate) -> dict[str, Any]:
    """Create a run. The answer holds its `api_key` (shown once): the agents' key, which creates
    and uses sessions of this run only."""
    validate_run_config(gw, body.config)
    run = await gw.store.create_run(body.name, body.config)
    key = await gw.store.new_run_key(run.id)
    return {**run_json(run), "api_key": key}


def validate_run_config(gw: GatewayDep, config: dict[str, Any]) -> None:
    """A run's config, checked by the composed check (the trainer's, under `rlgateway serve`)."""
    try:
        gw.check_run_config(config)
    except ValueError as exc:
        raise BadRequest(str(exc), param="config") from None


@router.get("/runs")
async def list_runs(gw: GatewayDep, _: AdminDep) -> dict[str, Any]:
    """Every run, newest first, with session counts and its newest training step."""
    return {"runs": [run_summary_json(r) for r in await gw.store.list_runs()]}


@router.get("/runs/{run_id}", responses=_RUN)
async def get_run(gw: GatewayDep, _: RunAgentDep, run_id: str) -> dict[str, Any]:
    """The run, with `outcomes`: how many of its sessions were settled in each outcome
    (trained, stale, filtered, untrainable, incomplete, orphaned by the trainer; failed by their
    agent) and how many are `pending`."""
    run = await gw.store.get_run(run_id)
    return {**run_json(run), "outcomes": await gw.store.outcome_counts(run_id)}


async def _set_status(gw: GatewayDep, run_id: str, status: RunStatus) -> dict[str, Any]:
    run = await gw.store.get_run(run_id)
    if run.status == RunStatus.STOPPED and status != RunStatus.STOPPED:
        raise Conflict(f"run {run_id} is stopped for good: create a new run to train again")
    return run_json(await gw.store.set_run_status(run_id, status))


@router.post("/runs/{run_id}/pause", responses=_STATUS)
async def pause_run(gw: GatewayDep, _: RunAdminDep, run_id: str) -> dict[str, Any]:
    """The trainer starts no new step until resumed (a step under way finishes)."""
    return await _set_status(gw, run_id, RunStatus.PAUSED)


@router.post("/runs/{run_id}/resume", responses=_STATUS)
async def resume_run(gw: GatewayDep, _: RunAdminDep, run_id: str) -> dict[str, Any]:
    return await _set_status(gw, run_id, RunStatus.ACTIVE)


@router.post("/runs/{run_id}/stop", responses=_STATUS)
async def stop_run(gw: GatewayDep, _: RunAdminDep, run_id: str) -> dict[str, Any]:
    """End training: the trainer finishes after the step under way; no new sessions."""
    return await _set_status(gw, run_id, RunStatus.STOPPED)


@router.delete("/runs/{run_id}", responses=_RUN)
async def delete_run(gw: GatewayDep, _: RunAdminDep, run_id: str) -> dict[str, Any]:
    """Delete the run with all its sessions, turns, rewards and training steps, in one
    transaction. Checkpoints on the trainer's disk are left alone."""
    ids = await gw.store.delete_run(run_id)
    gw.sessions.forget_run(run_id, ids)
    for sid in ids:
        gw.recorder.tracker.forget(sid)
    return {"id": run_id, "deleted": True, "sessions": len(ids)}


@router.post("/runs/{run_id}/key", responses=_RUN)
async def new_run_key(gw: GatewayDep, _: RunAdminDep, run_id: str) -> dict[str, Any]:
    """Replace the run's agent key: the old one stops working at once, on every gateway."""
    key = await gw.store.new_run_key(run_id)
    gw.sessions.forget_run(run_id)
    return {"id": run_id, "api_key": key}
