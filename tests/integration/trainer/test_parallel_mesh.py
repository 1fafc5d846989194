"""Two gloo processes under torchrun build the mesh of each parallel dimension: named dimensions
in pp, dp, cp, tp order, only those above 1 besides dp, and the groups FSDP and tensor
parallelism would use (tests/support/workers/mesh_worker.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.torchrun import torchrun
from tests.support.workers import mesh_worker

pytestmark = pytest.mark.slow


def test_two_ranks_build_each_dimensions_mesh(tmp_path: Path) -> None:
    torchrun(mesh_worker.__file__, [str(tmp_path)], timeout=120)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]

    for r, meshes in enumerate(ranks):
        # a bare fsdp: the 1-D mesh over both ranks, as the FSDP backend has always sharded
        assert meshes["fsdp"] == {"names": ["dp"], "shape": [2], "data": [0, 1], "tensor": None}
        # tensor parallel: both ranks in one tensor group, each its own data group
        assert meshes["fsdp:t2"] == {
            "names": ["dp", "tp"],
            "shape": [1, 2],
            "data": [r],
            "tensor": [0, 1],
        }
        # context parallel: FSDP shards over dp x cp flattened, so over both ranks
        assert meshes["fsdp:c2"] == {
            "names": ["dp", "cp"],
            "shape": [1, 2],
            "data": [0, 1],
            "tensor": None,
        }
        # pipeline stages are the outermost dimension; each stage's data group is one rank
        assert meshes["fsdp:p2"] == {
            "names": ["pp", "dp"],
            "shape": [2, 1],
            "data": [r],
            "tensor": None,
        }
