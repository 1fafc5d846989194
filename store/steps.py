"""The training time series: one row per trainer step, written by the trainer after it publishes
the step's policy, read by the admin API, the page and `/metrics`."""

from __future__ import annotations

import math
from typing import Any

from sqlalchemy import delete, func, select

from store.db import Database, utcnow
from store.errors import NotFoundError
from store.tables import RunRow, TrainStepRow
from store.types import JSON, TrainStep


def _clean(metrics: JSON) -> JSON:
    """JSON-safe values: non-finite floats become None (JSON has no NaN)."""
    out: dict[str, Any] = {}
    for k, v in metrics.items():
        out[k] = None if isinstance(v, float) and not math.isfinite(v) else v
    return out


def _step(row: TrainStepRow) -> TrainStep:
    return TrainStep(
        run_id=row.run_id,
        step=row.step,
        version=row.version,
        metrics=row.metrics,
        checkpoint=row.checkpoint,
        created_at=row.created_at,
    )


async def record_step(
    db: Database, run_id: str, step: int, *, version: int, metrics: JSON, checkpoint: str | None
) -> None:
    """Record (or, for a step trained again after a crash, replace) one step's row."""
    async with db.write() as s:
        if await s.get(RunRow, run_id) is None:
            raise NotFoundError(f"no run {run_id!r}: its steps cannot be recorded")
        await s.execute(
            delete(TrainStepRow).where(TrainStepRow.run_id == run_id, TrainStepRow.step == step)
        )
        s.add(
            TrainStepRow(
                run_id=run_id,
                step=step,
                version=version,
                metrics=_clean(metrics),
                checkpoint=checkpoint,
                created_at=utcnow(),
            )
        )


async def list_steps(
    db: Database, run_id: str, *, after: int | None = None, limit: int = 10_000
) -> list[TrainStep]:
    """The run's steps in order, those after step `after` only when given."""
    stmt = select(TrainStepRow).where(TrainStepRow.run_id == run_id)
    if after is not None:
        stmt = stmt.where(TrainStepRow.step > after)
    async with db.read() as s:
        rows = await s.scalars(stmt.order_by(TrainStepRow.step).limit(limit))
        return [_step(r) for r in rows]


async def latest_steps(db: Database, run_ids: list[str]) -> dict[str, TrainStep]:
    """The newest step of each of these runs (runs without steps are absent)."""
    if not run_ids:
        return {}
    newest = (
        select(TrainStepRow.run_id, func.max(TrainStepRow.step).label("step"))
        .where(TrainStepRow.run_id.in_(run_ids))
        .group_by(TrainStepRow.run_id)
        .subquery()
    )
    async with db.read() as s:
        rows = await s.scalars(
            select(TrainStepRow).join(
                newest,
                (newest.c.run_id == TrainStepRow.run_id) & (newest.c.step == TrainStepRow.step),
            )
        )
        return {r.run_id: _step(r) for r in rows}
