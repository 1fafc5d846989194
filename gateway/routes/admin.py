"""Operator endpoints (admin token): the policy version, and new weights into the engine (what a
trainer in another process calls after each step), from disk or over a weight group.

Each load from disk is recorded as the newest published policy, which a restarted gateway serves
again (`gateway.published`). Over a weight group (remote servers only; `trainer.collective` is
the trainer's side): `GET /admin/weights/group` says how many ranks the servers take and whether
the group they joined last is intact, `POST /admin/weights/group` makes every server join the
trainer's group, and `POST /admin/weights/broadcast` makes them receive one version while the
trainer sends it. A broadcast is recorded without a directory: the servers keep it across a
gateway restart, but nothing on disk holds it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter
from pydantic import Field

from engines.base import Broadcast, TensorMeta, WeightGroup, WeightGroupMember, WeightUpdate
from engines.limits import MAX_POLICY_VERSION
from gateway.deps import GatewayDep
from gateway.errors import BadRequest, Conflict, error_docs
from gateway.limits import CheckedBody
from gateway.routes.access import AdminDep

router = APIRouter(prefix="/admin", tags=["admin"], responses=error_docs(401, 403, 500))


class WeightsIn(CheckedBody):
    path: str
    """A Hugging Face model directory with the new weights (safetensors)."""
    version: int | None = None
    """The policy version these weights are, in [current + 1, `MAX_POLICY_VERSION`], or the
    current version itself (a no-op: a restarted trainer publishing what is served already);
    default current + 1."""


@router.get("/version")
async def version(gw: GatewayDep, _: AdminDep) -> dict[str, Any]:
    return {"version": gw.engine.version()}


@router.post("/weights", responses=error_docs(400, 409, 413, 422, 503))
async def load_weights(gw: GatewayDep, _: AdminDep, body: WeightsIn) -> dict[str, Any]:
    """Load the weights in `path` as policy `version` and record them as the newest published
    policy (a restarted gateway serves it again). `changed` is false when `version` is the one
    served already: nothing is loaded."""
    served = gw.engine.version()
    if _already_served(served, body.version):
        return {"version": served, "changed": False}
    path = await asyncio.to_thread(_model_dir, Path(body.path))
    version = await gw.engine.update_weights(WeightUpdate(path=path, version=body.version))
    await gw.store.record_policy(version, str(path))
    return {"version": version, "changed": True}


def _already_served(served: int, version: int | None) -> bool:
    """Whether `version` is the one served (a no-op); BadRequest unless it is that or newer,
    within `MAX_POLICY_VERSION` (the store records versions as int32: a larger one would fail
    every later turn). None means served + 1."""
    if version == served:
        return True
    newest = served + 1
    if version is not None and not newest <= version <= MAX_POLICY_VERSION:
        raise BadRequest(
            f"version must be in [{newest}, {MAX_POLICY_VERSION}] (newer than the engine's "
            f"version {served}, and at most {MAX_POLICY_VERSION}), or {served} itself (a "
            f"no-op), got {version}",
            param="version",
        )
    return False


def _model_dir(path: Path) -> Path:
    """`path` made absolute (a restarted gateway may run elsewhere); BadRequest unless it is a
    directory."""
    if not path.is_dir():
        raise BadRequest(f"{path} is not a directory on the gateway's machine", param="path")
    return path.resolve()


DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int8", "uint8", "bool")
"""The tensor dtypes a broadcast may carry (torch names)."""


class GroupIn(CheckedBody):
    master_address: str = Field(min_length=1, max_length=255)
    """Where the trainer (rank 0) listens: an address every server can reach."""
    master_port: int = Field(ge=1, le=65535)
    world_size: int = Field(ge=2, le=65536)
    """The trainer's rank and the servers' (`GET /admin/weights/group`'s `world_size`)."""
    backend: Literal["nccl", "gloo"] = "nccl"
    name: str = Field(default="rlgateway-weights", min_length=1, max_length=128)
    timeout_s: float = Field(default=300.0, gt=0, le=3600)
    """Bounds the join, and later each broadcast into the group."""


class TensorIn(CheckedBody):
    name: str = Field(min_length=1, max_length=1024)
    dtype: Literal[DTYPES]  # type: ignore[valid-type]
    shape: list[Annotated[int, Field(ge=0, le=2**40)]] = Field(max_length=16)


class BroadcastIn(CheckedBody):
    buckets: list[list[TensorIn]] = Field(min_length=1, max_length=100_000)
    """The tensors in the order the trainer sends them, in buckets the servers load one at a
    time."""
    version: int | None = None
    """As for `POST /admin/weights`."""


def _member(gw: Any) -> WeightGroupMember:
    if not isinstance(gw.engine, WeightGroupMember):
        raise Conflict(
            "the gateway's engine runs in process and takes no weight group: publish the "
            "weights through POST /admin/weights"
        )
    return gw.engine


@router.get("/weights/group")
async def weight_group(gw: GatewayDep, _: AdminDep) -> dict[str, Any]:
    """`world_size`: the trainer's rank and every answering server's; `intact`: whether the group
    they joined last can take a broadcast now (false: form it again)."""
    member = _member(gw)
    ranks = await member.weight_group_ranks()
    return {"world_size": 1 + ranks, "intact": member.weight_group_intact()}


@router.post("/weights/group", responses=error_docs(400, 409, 413, 422, 503))
async def join_weight_group(gw: GatewayDep, _: AdminDep, body: GroupIn) -> dict[str, Any]:
    """Every answering server joins the trainer's group (ranks 1 .. world_size - 1); answers when
    all have, which needs the trainer to join at the same time. 409 when one cannot."""
    member = _member(gw)
    ranks = await member.weight_group_ranks()
    if 1 + ranks != body.world_size:  # refused before any server leaves the group it is in
        raise Conflict(
            f"the weight group has {body.world_size} ranks, but the trainer's 1 and the "
            f"servers' {ranks} make {1 + ranks}: ask GET /admin/weights/group again"
        )
    group = WeightGroup(
        master_address=body.master_address,
        master_port=body.master_port,
        world_size=body.world_size,
        backend=body.backend,
        name=body.name,
        timeout_s=body.timeout_s,
    )
    await member.join_weight_group(group)
    return {"world_size": body.world_size, "intact": True}


@router.post("/weights/broadcast", responses=error_docs(400, 409, 413, 422, 503))
async def broadcast_weights(gw: GatewayDep, _: AdminDep, body: BroadcastIn) -> dict[str, Any]:
    """Receive policy `version` over the weight group while the trainer broadcasts it. All or
    nothing: on any failure (409) the version stays and the group must be formed again."""
    _member(gw)
    served = gw.engine.version()
    if _already_served(served, body.version):
        return {"version": served, "changed": False}
    broadcast = Broadcast(
        tuple(
            tuple(TensorMeta(t.name, t.dtype, tuple(t.shape)) for t in bucket)
            for bucket in body.buckets
            if bucket
        )
    )
    if not broadcast.buckets:
        raise BadRequest("the broadcast has no tensors", param="buckets")
    version = await gw.engine.update_weights(
        WeightUpdate(broadcast=broadcast, version=body.version)
    )
    await gw.store.record_policy(version, None)
    return {"version": version, "changed": True}
