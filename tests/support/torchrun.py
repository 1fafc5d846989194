"""Running a test's worker script on N gloo processes under torchrun, and comparing state dicts.

The multi-process tests (FSDP data parallel, the device mesh, tensor and context parallel) each
run a worker module of `tests/support/workers` as `torchrun --nproc-per-node N WORKER ARGS...` and
compare what its ranks wrote with the same run in the test's own process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import NoReturn

import torch

from tests.support.gateway_server import free_port

ROOT = Path(__file__).resolve().parents[2]


def torchrun(worker: str, args: list[str], *, nproc: int = 2, timeout: float = 300) -> None:
    """Runs `worker` (a script path) with `args` on `nproc` processes (one thread each; the
    repository on the path, as workers import each other as `tests.support.workers`); asserts that
    every rank exited 0, with the tails of their output."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    cmd += ["--master-port", str(free_port()), worker, *args]
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def exit_worker() -> NoReturn:
    """A worker's end, once its results are on disk: the process group destroyed, then the
    process gone without the interpreter's teardown. Some gloo workers aborted in that teardown
    (SIGABRT, "terminate called without an active exception") after writing their results, in
    about 1 of 20 runs under load; what is still alive then is not known (see BENCHMARKS.md,
    "Trainer: parallel strategies side by side"), so the workers do not wait for it."""
    from trainer.backends.fsdp import shutdown_distributed

    sys.stdout.flush()
    sys.stderr.flush()
    shutdown_distributed()
    os._exit(0)


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest elementwise difference between two state dicts of the same names and shapes."""
    assert a.keys() == b.keys()
    assert all(a[k].shape == b[k].shape for k in a)
    return max(float((a[k] - b[k]).abs().max()) for k in a)
