"""A session's rewards, its end, and its recorded segments (session key or admin token)."""

from __future__ import annotations

import math
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field, field_validator

from gateway.app import Gateway, GatewayDep
from gateway.auth import resolve
from store.types import SessionDetail, SessionInfo

router = APIRouter(tags=["sessions"])


class RewardIn(BaseModel):
    reward: float
    completion_id: str | None = None
    """The turn this reward is for; omit it for the episode's final reward."""
    key: str | None = Field(None, max_length=200)
    """Idempotency key: posting the same key and value again changes nothing."""

    @field_validator("reward")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("reward must be a finite number")
        return v


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
    }


def detail_json(d: SessionDetail) -> dict[str, Any]:
    return {
        **info_json(d.info),
        "rewards": [
            {
                "reward": r.value,
                "completion_id": r.completion_id,
                "key": r.key,
                "created_at": r.created_at.isoformat(),
            }
            for r in d.rewards
        ],
        "returns": d.returns,
        "finish_reasons": d.finish_reasons,
        "segments": [
            {
                "id": s.id,
                "index": s.index,
                "completion_ids": s.completion_ids,
                "turn_spans": [list(span) for span in s.turn_spans],
                "tokens": s.tokens,
                "loss_mask": s.loss_mask,
                "logprobs": s.logprobs,
                "versions": s.versions,
            }
            for s in d.segments
        ],
    }


async def _gamma(gw: Gateway, run_id: str) -> float:
    run = await gw.store.get_run(run_id)
    return float(run.config.get("discount", gw.settings.discount))


@router.post("/sessions/{session_id}/reward")
async def reward(
    gw: GatewayDep, request: Request, session_id: str, body: RewardIn
) -> dict[str, Any]:
    await resolve(request, gw.sessions, gw.settings.admin_token, session_id)
    recorded = await gw.store.add_reward(
        session_id, body.reward, completion_id=body.completion_id, key=body.key
    )
    return {"session_id": session_id, "recorded": recorded}


@router.post("/sessions/{session_id}/end")
async def end(gw: GatewayDep, request: Request, session_id: str) -> dict[str, Any]:
    await resolve(request, gw.sessions, gw.settings.admin_token, session_id)
    info = await gw.store.end_session(session_id)
    gw.sessions.remember(info)
    return info_json(info)


@router.get("/sessions/{session_id}")
async def get_session(gw: GatewayDep, request: Request, session_id: str) -> dict[str, Any]:
    caller = await resolve(request, gw.sessions, gw.settings.admin_token, session_id)
    assert caller.session is not None
    gamma = await _gamma(gw, caller.session.run_id)
    return detail_json(await gw.store.session_detail(session_id, gamma=gamma))
