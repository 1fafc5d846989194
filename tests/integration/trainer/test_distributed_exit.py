"""A trainer ends with no gloo thread alive: `shutdown_distributed` frees every process group
(the default one and the meshes' groups that FSDP's and DTensor's state still hold) while the
interpreter is intact. A group freed in interpreter finalization instead can end a worker thread
with std::terminate (SIGABRT after the work was done: `rlgateway train` under torchrun did)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.torchrun import ROOT

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    def gloo_threads():
        names = [p.read_text().strip() for p in Path("/proc/self/task").glob("*/comm")]
        return sorted(n for n in names if "gloo" in n)

    from trainer.backends.fsdp import FSDPBackend, shutdown_distributed
    from trainer.parallel.strategy import parse_allocation

    backend = FSDPBackend(sys.argv[1], allocation=parse_allocation("fsdp"))
    print("alive", gloo_threads(), flush=True)
    del backend
    shutdown_distributed()
    print("after", gloo_threads(), flush=True)
    """
)


def test_shutdown_joins_every_gloo_thread(tiny_model: Path, tmp_path: Path) -> None:
    script = tmp_path / "exit.py"
    script.write_text(SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script), str(tiny_model)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    assert "pt_gloo_runloop" in lines["alive"], out.stdout  # the test sees the threads
    assert lines["after"] == "[]", out.stdout
