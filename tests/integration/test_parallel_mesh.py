"""Two gloo processes under torchrun build the mesh of each parallel dimension: named dimensions
in pp, dp, cp, tp order, only those above 1 besides dp, and the groups FSDP and tensor
parallelism would use (tests/integration/mesh_worker.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration import mesh_worker

pytestmark = pytest.mark.slow


def test_two_ranks_build_each_dimensions_mesh(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["--master-port", str(port), mesh_worker.__file__, str(tmp_path)]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
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
