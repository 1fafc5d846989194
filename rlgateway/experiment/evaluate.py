"""Evaluation on the held-out split, through the gateway like every rollout, into the evaluation
run (which nothing trains): per row one greedy answer (temperature 0) and, with `samples: k`, k
answers at the run's temperature. Returns one metrics row whose keys begin with `eval`."""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

from rlgateway.experiment.rollouts import EpisodeResult, Rollouts, Sampling, Tally
from rlgateway.experiment.spec import EvalSpec
from rlgateway.experiment.workflows import Row


async def evaluate(
    rollouts: Rollouts,
    run_id: str,
    rows: list[Row],
    spec: EvalSpec,
    *,
    step: int,
    temperature: float,
    max_tokens: int | None,
) -> dict[str, Any]:
    t0 = time.perf_counter()
    rows = rows[: spec.limit] if spec.limit is not None else rows
    plan = [Sampling(0.0, max_tokens, True)] if spec.greedy else []
    plan += [Sampling(temperature, max_tokens, True)] * spec.samples
    gate = asyncio.Semaphore(max(1, spec.concurrency // max(1, len(plan))))
    tally = Tally()
    own = Rollouts(
        rollouts.client, rollouts.workflow, rollouts.reward, model=rollouts.model, tally=tally
    )

    async def one(i: int, row: Row) -> list[EpisodeResult]:
        async with gate:
            got = await own.group(
                run_id,
                row,
                size=len(plan),
                group_id=f"eval-step{step}-{i}",
                metadata={"eval_step": step, "row": i, "prompt": str(row.get("prompt", ""))[:500]},
                sampling=plan,
            )
            assert got is not None  # the evaluation run is not throttled
            return got

    first = await rollouts.client.version()
    try:
        results = await asyncio.gather(*(one(i, r) for i, r in enumerate(rows)))
    finally:
        await own.close()
    last = await rollouts.client.version()
    # a policy published meanwhile answered part of it: the row says which versions did
    out: dict[str, Any] = {"step": step, "eval_rows": len(rows)}
    out |= {"eval_version_first": first, "eval_version_last": last}
    if spec.greedy:
        greedy = [r[0].reward for r in results]
        out["eval_accuracy"] = _mean(
            [1.0 if v is not None and v >= spec.solved else 0.0 for v in greedy]
        )
        out["eval_greedy_reward"] = _mean([v if v is not None else 0.0 for v in greedy])
    if spec.samples:
        sampled = [r[int(spec.greedy) :] for r in results]
        values = [e.reward if e.reward is not None else 0.0 for s in sampled for e in s]
        out["eval_reward_mean"] = _mean(values)
        out[f"eval_pass_at_{spec.samples}"] = _mean(
            [
                1.0 if any(e.reward is not None and e.reward >= spec.solved for e in s) else 0.0
                for s in sampled
            ]
        )
    out["eval_failed"] = sum(tally.failures.values())
    out["eval_seconds"] = round(time.perf_counter() - t0, 2)
    return out


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else 0.0
