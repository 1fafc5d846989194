"""The torch `DeviceMesh` of a `ParallelStrategy`, with named dimensions.

Dimensions, outermost first: `pp`, `dp`, `cp`, `tp` (torchtitan's `ParallelDims` order).
Consecutive ranks, which torchrun places on one node, form the tensor group, the one that talks
most (every layer), then the context group; pipeline stages, which pass only activations between
them, are furthest apart. `dp` is always built, of size 1 too: it is what FSDP shards over, and a
one-rank world needs a mesh as well. `pp`, `cp` and `tp` are built only when their size is above
1, so a strategy's mesh has exactly the dimensions it parallelises over, and a data-parallel
strategy's is the 1-D mesh over every rank. Where cp > 1, `dp` and `cp` are also flattened into
`dp_cp`: FSDP shards the parameters over both (a context rank holds the whole model for its part
of each sequence, as a data rank does for its part of the batch), and gradients are reduced over
both; `context_mesh` is the `cp` group that Ulysses attention all-to-alls over. Expert
parallelism is no dimension of this mesh: its groups regroup the data ranks
(`trainer.parallel.strategy`), in a mesh of their own (`trainer.parallel.expert.expert_mesh`).
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainer.parallel.strategy import ParallelStrategy, validate_world


def build_mesh(strategy: ParallelStrategy, device_type: str) -> DeviceMesh:
    """The mesh of `strategy` over the default process group (every rank calls this, after
    joining the group); ValueError when the strategy does not span the group's ranks."""
    validate_world(strategy, dist.get_world_size())
    dims = [
        (name, size)
        for name, size in (
            ("pp", strategy.pipeline),
            ("dp", strategy.data),
            ("cp", strategy.context),
            ("tp", strategy.tensor),
        )
        if size > 1 or name == "dp"
    ]
    names = tuple(name for name, _ in dims)
    mesh = init_device_mesh(device_type, tuple(size for _, size in dims), mesh_dim_names=names)
    if strategy.context > 1:
        mesh["dp", "cp"]._flatten("dp_cp")
    return mesh


def data_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The submesh FSDP shards over and losses are reduced over: `dp`, or `dp_cp` (dp x cp
    flattened) where the mesh has `cp`."""
    return mesh["dp_cp"] if "cp" in (mesh.mesh_dim_names or ()) else mesh["dp"]


def tensor_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The tensor-parallel submesh; None where the strategy has no tensor parallelism."""
    return mesh["tp"] if "tp" in (mesh.mesh_dim_names or ()) else None


def context_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The context-parallel submesh; None where the strategy has no context parallelism."""
    return mesh["cp"] if "cp" in (mesh.mesh_dim_names or ()) else None
