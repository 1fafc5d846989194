"""A session's rewards, its end, and its recorded segments (the session's key, its run's key, or
the admin token), and a reward set by hand (admin)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from pydantic import Field, Strict

from gateway.auth import resolve
from gateway.deps import Gateway, GatewayDep
from gateway.errors import error_docs
from gateway.limits import CheckedBody
from gateway.routes.access import DOC_BEARER, AdminDep
from gateway.run_configs import discount_of
from gateway.views import detail_json, info_json
from store.rewards import MAX_ABS_REWARD
from store.sessions import MAX_FAILURE_CHARS

router = APIRouter(
    tags=["sessions"],
    dependencies=[Depends(DOC_BEARER)],
    responses=error_docs(401, 403, 404, 422, 500),
)

Reward = Annotated[
    float, Strict(), Field(ge=-MAX_ABS_REWARD, le=MAX_ABS_REWARD, allow_inf_nan=False)
]
"""A number (not a boolean or string) in [-1e6, 1e6]: a session's total stays finite."""


class RewardIn(CheckedBody):
    reward: Reward
    completion_id: str | None = None
    """The turn this reward is for; omit it for the episode's final reward."""
    key: str | None = Field(None, max_length=200)
    """Idempotency key: posting the same key and value again changes nothing."""


class RewardSet(CheckedBody):
    reward: Reward
    completion_id: str | None = None
    """The turn whose reward is set; omit it to set the episode's final reward."""


class EndIn(CheckedBody):
    failure: str | None = Field(None, min_length=1, max_length=MAX_FAILURE_CHARS)
    """Why the episode failed (its reward function raised, its agent crashed, ...): the session
    is settled as `failed` at once, never trained, and its group is judged without it. Omit it
    to end the session as usual."""


async def _gamma(gw: Gateway, run_id: str) -> float:
    return discount_of(await gw.run_configs.of(run_id), gw.settings.discount)


@router.post("/sessions/{session_id}/reward", responses=error_docs(400, 409, 413))
async def reward(
    gw: GatewayDep, request: Request, session_id: str, body: RewardIn
) -> dict[str, Any]:
    """Record a reward. A session the trainer already took (trained, dropped, or in a step)
    answers 409, unless the run's `late_rewards` is `record`: then it is kept, flagged `late`,
    for the export only."""
    caller = await resolve(request, gw.sessions, gw.settings.admin_token, session_id)
    assert caller.session is not None
    late = (await gw.run_configs.of(caller.session.run_id)).late_rewards
    recorded = await gw.store.add_reward(
        session_id, body.reward, completion_id=body.completion_id, key=body.key, late=late
    )
    if recorded:
        gw.metrics.rewards.labels(source="api").inc()
    return {"session_id": session_id, "recorded": recorded}


@router.put("/sessions/{session_id}/reward", responses=error_docs(400, 413))
async def set_reward(
    gw: GatewayDep, _: AdminDep, session_id: str, body: RewardSet
) -> dict[str, Any]:
    """Set or override a reward by hand: every reward the turn (or, without `completion_id`,
    the episode's final reward) holds is replaced by this one, atomically. A trajectory the
    trainer already consumed keeps its trained result; the export shows the new reward."""
    await gw.store.set_reward(session_id, body.reward, completion_id=body.completion_id)
    gw.metrics.rewards.labels(source="manual").inc()
    info = await gw.store.get_session(session_id)
    d = await gw.store.session_detail(session_id, gamma=await _gamma(gw, info.run_id))
    return {"session_id": session_id, "rewards": detail_json(d)["rewards"], "returns": d.returns}


@router.post("/sessions/{session_id}/end", responses=error_docs(400, 409, 413))
async def end(
    gw: GatewayDep, request: Request, session_id: str, body: EndIn | None = None
) -> dict[str, Any]:
    """End the session (again: no change). With `{"failure": "why"}` it ends as failed: settled
    at once (`outcome` failed, the reason in `failure`), never trained, and its group is judged
    without it. A session the trainer already took (claimed, trained or dropped) cannot fail:
    409; failing it again with the same reason changes nothing."""
    await resolve(request, gw.sessions, gw.settings.admin_token, session_id)
    failure = body.failure if body is not None else None
    info = await gw.store.end_session(session_id, failure=failure)
    gw.sessions.remember(info)
    return info_json(info)


@router.get("/sessions/{session_id}")
async def get_session(
    gw: GatewayDep, request: Request, session_id: str, texts: bool = False
) -> dict[str, Any]:
    """The session with its segments: `tokens`, `loss_mask`, `logprobs`, `versions` (one
    length), the turns' spans, rewards and discounted returns. `texts=true` adds each token's
    text (`texts`, per segment) for display."""
    caller = await resolve(request, gw.sessions, gw.settings.admin_token, session_id)
    assert caller.session is not None
    gamma = await _gamma(gw, caller.session.run_id)
    out = detail_json(await gw.store.session_detail(session_id, gamma=gamma))
    if texts:
        tok = gw.components.tokenizer
        for seg in out["segments"]:
            seg["texts"] = [tok.decode([t], skip_special_tokens=False) for t in seg["tokens"]]
    return out
