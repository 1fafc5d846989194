"""The JSON shapes of runs, sessions and training steps in API responses (one place, so the
admin API, the export and the page agree)."""

from __future__ import annotations

from typing import Any

from store.types import (
    Reward,
    Run,
    RunSummary,
    SessionDetail,
    SessionInfo,
    SessionSummary,
    TrainStep,
)


def run_json(run: Run) -> dict[str, Any]:
    return {
        "id": run.id,
        "name": run.name,
        "config": run.config,
        "status": run.status,
        "created_at": run.created_at.isoformat(),
    }


def run_summary_json(r: RunSummary) -> dict[str, Any]:
    return {
        **run_json(r.run),
        "sessions": r.sessions,
        "active_sessions": r.active,
        "rewarded_sessions": r.rewarded,
        "consumed_sessions": r.consumed,
        "last_step": r.last_step,
    }


def info_json(info: SessionInfo) -> dict[str, Any]:
    return {
        "id": info.id,
        "run_id": info.run_id,
        "group_id": info.group_id,
        "metadata": info.metadata,
        "status": info.status.value,
        "created_at": info.created_at.isoformat(),
        "ended_at": info.ended_at.isoformat() if info.ended_at else None,
        "prefix_breaks": info.prefix_breaks,
        "train_state": info.train_state.value,
        "outcome": info.outcome.value if info.outcome is not None else None,
        "consumed_step": info.consumed_step,
        "failure": info.failure,
    }


def summary_json(s: SessionSummary) -> dict[str, Any]:
    return {**info_json(s.info), "turns": s.turns, "reward": s.reward}


def reward_json(r: Reward) -> dict[str, Any]:
    return {
        "reward": r.value,
        "completion_id": r.completion_id,
        "key": r.key,
        "created_at": r.created_at.isoformat(),
        "late": r.late,
    }


def detail_json(d: SessionDetail) -> dict[str, Any]:
    return {
        **info_json(d.info),
        "rewards": [reward_json(r) for r in d.rewards],
        "returns": d.returns,
        "finish_reasons": d.finish_reasons,
        "segments": [
            {
                "id": s.id,
                "index": s.index,
                "completion_ids": s.completion_ids,
                "turn_spans": [list(span) for span in s.turn_spans],
                "turn_sampling": s.turn_sampling,
                "turn_side": s.turn_side,
                "tokens": s.tokens,
                "loss_mask": s.loss_mask,
                "logprobs": s.logprobs,
                "versions": s.versions,
            }
            for s in d.segments
        ],
    }


def step_json(s: TrainStep) -> dict[str, Any]:
    return {
        "step": s.step,
        "version": s.version,
        "checkpoint": s.checkpoint,
        "created_at": s.created_at.isoformat(),
        "metrics": s.metrics,
    }
