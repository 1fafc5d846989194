"""A run's training as the trainer recorded it: metrics per step as time series, and the policy
versions it published with their checkpoints (admin or the run's key)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query

from gateway.deps import GatewayDep
from gateway.errors import error_docs
from gateway.limits import MAX_INT32
from gateway.routes.access import RunAgentDep
from gateway.views import step_json

router = APIRouter(tags=["training"], responses=error_docs(401, 403, 404, 422, 500))


@router.get("/runs/{run_id}/metrics")
async def run_metrics(
    gw: GatewayDep,
    _: RunAgentDep,
    run_id: str,
    after: Annotated[int | None, Query(ge=-1, le=MAX_INT32)] = None,
) -> dict[str, Any]:
    """The training time series: `steps` (the step numbers) and `series`, one list per metric
    (reward_mean, loss, staleness_mean, tokens_per_s, step_seconds, ...), aligned with `steps`
    (null where a step lacks the metric). `after=N` returns only later steps, for polling."""
    await gw.store.get_run(run_id)
    rows = await gw.store.list_steps(run_id, after=after)
    names = sorted({k for r in rows for k, v in r.metrics.items() if _numeric(v)} - {"step"})
    return {
        "run_id": run_id,
        "steps": [r.step for r in rows],
        "times": [r.created_at.isoformat() for r in rows],
        "series": {n: [_num(r.metrics.get(n)) for r in rows] for n in names},
    }


def _numeric(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _num(v: object) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


@router.get("/runs/{run_id}/versions")
async def run_versions(gw: GatewayDep, _: RunAgentDep, run_id: str) -> dict[str, Any]:
    """The policy versions the run's trainer published (one per step) with their checkpoint
    paths, and the version the engine serves now."""
    await gw.store.get_run(run_id)
    rows = await gw.store.list_steps(run_id)
    return {
        "run_id": run_id,
        "engine_version": gw.engine.version(),
        "versions": [{k: v for k, v in step_json(r).items() if k != "metrics"} for r in rows],
    }
