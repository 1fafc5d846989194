"""Runs `rlgateway serve` as a real subprocess on loopback for tests.

`run_gateway(model_dir, tmp_path)` starts the gateway on a free port with a SQLite store in
`tmp_path`, waits until `GET /health` answers 200, yields a `GatewayHandle`, and stops the server
(SIGTERM, then SIGKILL) on exit. The server's output goes to `tmp_path/gateway.log`, whose tail is
shown when it fails to come up.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class GatewayHandle:
    url: str
    """http://127.0.0.1:PORT (no trailing slash, no /v1)."""
    admin_token: str
    database_url: str
    log_path: Path
    client: httpx.Client = field(repr=False)
    """Authorized with the admin token, base_url = `url`."""
    pid: int = 0
    """The `rlgateway serve` process, leader of its process group (its engine process too)."""
    _run_id: str | None = None

    @property
    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"}

    def trained_run(self, within: float = 60) -> str:
        """The id of the run `serve --train` says it trains (its "training run ID ..." line)."""
        deadline = time.monotonic() + within
        while True:
            lines = self.log_path.read_text().splitlines()
            runs = [
                line[line.index("training run ") :] for line in lines if "training run " in line
            ]
            if runs:
                return runs[0].split()[2]
            assert time.monotonic() < deadline, self.log_tail()
            time.sleep(0.1)

    def create_run(self, name: str = "test", config: Mapping[str, Any] | None = None) -> str:
        r = self.client.post("/runs", json={"name": name, "config": dict(config or {})})
        assert r.status_code == 201, r.text
        run_id: str = r.json()["id"]
        return run_id

    def new_sessions(
        self,
        count: int,
        *,
        run_id: str | None = None,
        group_id: str | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> list[dict[str, Any]]:
        """`count` new sessions (each `{"id", "base_url", "api_key", ...}`) of `run_id`, or of
        a run this handle creates once and reuses."""
        if run_id is None:
            if self._run_id is None:
                self._run_id = self.create_run()
            run_id = self._run_id
        body = {"count": count, "group_id": group_id, "metadata": dict(metadata or {})}
        r = self.client.post(f"/runs/{run_id}/sessions", json=body)
        assert r.status_code == 201, r.text
        sessions: list[dict[str, Any]] = r.json()["sessions"]
        return sessions

    def new_session(
        self,
        group_id: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        *,
        run_id: str | None = None,
    ) -> dict[str, Any]:
        return self.new_sessions(1, run_id=run_id, group_id=group_id, metadata=metadata)[0]

    def session(self, session_id: str) -> dict[str, Any]:
        """`GET /sessions/{id}` as the admin: status, segments, rewards, returns, ..."""
        r = self.client.get(f"/sessions/{session_id}")
        assert r.status_code == 200, r.text
        detail: dict[str, Any] = r.json()
        return detail

    def log_tail(self, lines: int = 60) -> str:
        return _tail(self.log_path, lines)


@contextmanager
def run_gateway(
    model_dir: str | Path,
    tmp_path: Path,
    *,
    admin_token: str = "test-admin",
    extra_env: Mapping[str, str] | None = None,
    extra_args: Sequence[str] = (),
    timeout: float = 120,
    port: int | None = None,
    database_url: str | None = None,
) -> Iterator[GatewayHandle]:
    """Serve `model_dir` with `rlgateway serve` on 127.0.0.1 (CPU) and yield its handle: on
    `port` (default a free one) and `database_url` (default an SQLite file in `tmp_path`)."""
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    database_url = database_url or f"sqlite:///{(tmp_path / 'gateway.db').resolve()}"
    cmd = [
        sys.executable,
        "-m",
        "rlgateway.cli",
        "serve",
        *("--host", "127.0.0.1", "--port", str(port)),
        *("--database-url", database_url),
        *("--admin-token", admin_token),
        *("--model", str(model_dir)),
        *("--device", "cpu"),
        *("--log-level", "warning"),
        *extra_args,
    ]
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        # One core for the engine's kernels: the test process needs the other.
        "OMP_NUM_THREADS": "1",
        **(extra_env or {}),
    }
    log_path = tmp_path / "gateway.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=REPO_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        _wait_healthy(proc, url, log_path, timeout)
        with httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {admin_token}"}, timeout=60
        ) as client:
            yield GatewayHandle(url, admin_token, database_url, log_path, client, proc.pid)
    finally:
        _stop(proc)


def serve(
    model_dir: Path, factory: Any, name: str, extra_args: Sequence[str] = ()
) -> Iterator[GatewayHandle]:
    """`rlgateway serve` on `model_dir` for a module fixture (`factory`: pytest's
    tmp_path_factory), checked at the end: no request ended in an unhandled server error."""
    with run_gateway(model_dir, factory.mktemp(name), extra_args=extra_args) as gw:
        yield gw
        log = gw.log_path.read_text(errors="replace")
        assert "Traceback" not in log, log[-4000:]


_PORTS = (20000, 32768)
"""Where test servers listen: below the kernel's ephemeral range (32768-60999 here), which hands
the same port to whoever asks next once it is free again, so a port picked by `bind(0)` in one
pytest worker could be picked again by another before the first server bound it (CI once saw a
test's health check answered by another worker's gateway). Each worker takes its own slice."""
_next_port: dict[str, int] = {}


def free_port() -> int:
    """A port no server of this test run is given twice at once: the next free one in this
    pytest-xdist worker's own slice of `_PORTS` (free = bindable on 127.0.0.1 now)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker.removeprefix("gw") or 0)
    workers = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), index + 1)
    size = (_PORTS[1] - _PORTS[0]) // workers
    low = _PORTS[0] + index * size
    start = _next_port.get(worker, low)
    for step in range(size):
        port = low + (start - low + step) % size
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _next_port[worker] = low + (port - low + 1) % size
        return port
    raise RuntimeError(f"no free port in {low}..{low + size - 1}")


def _wait_healthy(proc: subprocess.Popen[bytes], url: str, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"rlgateway serve exited with {proc.returncode}; log {log}:\n{_tail(log)}"
            )
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass  # not listening yet
        time.sleep(0.25)
    raise TimeoutError(
        f"rlgateway serve was not healthy after {timeout:.0f} s; log {log}:\n{_tail(log)}"
    )


def _stop(proc: subprocess.Popen[bytes], grace: float = 15) -> None:
    """SIGTERM to the server's process group, then SIGKILL if it outlives the grace period."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _tail(log: Path, lines: int = 60) -> str:
    if not log.exists():
        return "(no log)"
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
