"""The meshes of a few allocations on the ranks that torchrun starts (gloo, CPU).

`python -m torch.distributed.run --nproc-per-node 2 tests/support/workers/mesh_worker.py OUT` has
every rank resolve each of `ALLOCATIONS` for the world, build its mesh and write, per allocation,
the mesh's dimension names and shape and the ranks of this rank's data and tensor groups, to
OUT/rank{r}.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist

from trainer.parallel.mesh import build_mesh, data_mesh, tensor_mesh
from trainer.parallel.strategy import parse_allocation

ALLOCATIONS = ("fsdp", "fsdp:t2", "fsdp:c2", "fsdp:p2")
"""Data parallel over both ranks (what the FSDP backend builds), then each other dimension."""


def describe(text: str) -> dict[str, Any]:
    """`text`'s mesh on this world, as the test compares it."""
    mesh = build_mesh(parse_allocation(text).for_world(dist.get_world_size()), "cpu")
    tensor = tensor_mesh(mesh)
    return {
        "names": list(mesh.mesh_dim_names or ()),
        "shape": list(mesh.shape),
        "data": data_mesh(mesh).mesh.flatten().tolist(),
        "tensor": None if tensor is None else tensor.mesh.flatten().tolist(),
    }


def main(out: str) -> None:
    dist.init_process_group("gloo")
    try:
        result = {text: describe(text) for text in ALLOCATIONS}
        Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    from tests.support.torchrun import exit_worker

    main(*sys.argv[1:])
    exit_worker()
