"""A Ray cluster on this machine for the launch tests: a head and two worker nodes (each its own
raylet, as on separate machines), with custom resources standing in for what tells real nodes
apart. `ray start` runs each; `ray stop --force` ends them all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.support.gateway_server import free_port

RAY = str(Path(sys.executable).parent / "ray")
NODES = {
    "head": {"trainer_slot": 1},
    "a": {"replica_slot": 1, "trainer_slot": 1},
    "b": {"replica_slot": 1},
}
"""The custom resources of each node: one gateway replica fits each worker node, one trainer
node's bundle fits the head and worker a (a trainer of two nodes spreads over both)."""


def _ray(*args: str) -> None:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([RAY, *args], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


@contextmanager
def ray_cluster() -> Iterator[str]:
    """Yields the head's address (HOST:PORT)."""
    address = f"127.0.0.1:{free_port()}"
    common = ["--num-cpus", "1", "--object-store-memory", str(100 * 2**20), "--disable-usage-stats"]
    try:
        _ray("start", "--head", "--port", address.split(":")[1], "--include-dashboard=false",
             "--resources", json.dumps(NODES["head"]), *common)  # fmt: skip
        for node in ("a", "b"):
            _ray("start", "--address", address, "--resources", json.dumps(NODES[node]), *common)
        yield address
    finally:
        subprocess.run([RAY, "stop", "--force"], capture_output=True, timeout=120, check=False)
