"""Start and supervise a local inference server (vLLM, SGLang) as a child process.

`SupervisedServer` runs one server in a session of its own (so that stopping it stops the
processes it starts too: vLLM's engine core, SGLang's scheduler), waits until `GET /health`
answers, restarts it when it dies (up to `max_restarts`), and stops it. A subclass says how to
start its kind: `command()` and `env()` (`engines.vllm_launch`, `engines.sglang_launch`).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import httpx

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchConfig:
    """How to start a server (`VLLMLaunchConfig` and `SGLangLaunchConfig` add their own)."""

    model: str
    """A Hugging Face model directory."""
    python: str = "python3"
    """The interpreter of the server's own environment (vLLM and SGLang pin their own torch)."""
    host: str = "127.0.0.1"
    port: int = 0
    """0 picks a free port."""
    served_model_name: str = "tiny"
    dtype: str = "auto"
    max_model_len: int | None = None
    """The context length; None: the model's."""
    extra_args: tuple[str, ...] = ()
    """More flags for the server's command line, appended last."""
    env: Mapping[str, str] = field(default_factory=dict)
    """More environment variables (they win over the defaults)."""
    log_file: str | None = None
    """Where the server's output goes; default: a file in the temp directory."""


class SupervisedServer(abc.ABC):
    """One supervised server. `await start()`, use `url`, `await stop()`."""

    kind: ClassVar[str]
    """What it is called in logs and errors ("vLLM", "SGLang")."""

    def __init__(self, cfg: LaunchConfig, max_restarts: int = 3) -> None:
        if not (Path(cfg.model) / "config.json").is_file():
            raise ValueError(f"{cfg.model} is not a Hugging Face model directory (no config.json)")
        self.port = cfg.port or free_port(cfg.host)
        self.url = f"http://{cfg.host}:{self.port}"
        self.max_restarts = max_restarts
        self.restarts = 0
        tmp = Path(os.environ.get("TMPDIR", "/tmp"))
        self.log_path = Path(cfg.log_file or tmp / f"{self.kind.lower()}-{self.port}.log")
        self._proc: subprocess.Popen[bytes] | None = None
        self._watch: asyncio.Task[None] | None = None
        self._stopping = False

    @abc.abstractmethod
    def command(self) -> list[str]:
        """The server's command line (on `self.port`)."""

    @abc.abstractmethod
    def env(self) -> dict[str, str]:
        """The server's whole environment."""

    async def _prepare(self) -> None:  # noqa: B027 (a hook: most servers need nothing)
        """Called once before the first start (a subclass may inspect the environment)."""

    async def start(self, startup_s: float = 600) -> None:
        """Start the server and return once it is healthy; then watch it."""
        await self._prepare()
        await self._spawn(startup_s)
        name = f"{self.kind.lower()}-supervisor"
        self._watch = asyncio.create_task(self._supervise(startup_s), name=name)

    def _popen(self) -> subprocess.Popen[bytes]:
        with open(self.log_path, "ab") as out:
            return subprocess.Popen(
                self.command(),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env(),
                start_new_session=True,
            )

    async def _spawn(self, startup_s: float) -> None:
        self._proc = await asyncio.to_thread(self._popen)
        log.info(
            "%s starting at %s (pid %d, log %s)", self.kind, self.url, self._proc.pid, self.log_path
        )
        await self._wait_healthy(startup_s)

    async def _wait_healthy(self, startup_s: float) -> None:
        proc = self._proc
        assert proc is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + startup_s
        async with httpx.AsyncClient(timeout=5) as http:
            while loop.time() < deadline:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"{self.kind} exited with {proc.returncode}; log {self.log_path}:\n"
                        f"{self.tail()}"
                    )
                with contextlib.suppress(httpx.TransportError):
                    if (await http.get(f"{self.url}/health")).status_code == 200:
                        return
                await asyncio.sleep(1)
        await self._kill()
        raise TimeoutError(f"{self.kind} not healthy after {startup_s:.0f} s; log {self.log_path}")

    async def _supervise(self, startup_s: float) -> None:
        while not self._stopping:
            proc = self._proc
            assert proc is not None
            code = await asyncio.to_thread(proc.wait)
            if self._stopping:
                return
            if self.restarts >= self.max_restarts:
                log.error("%s at %s exited with %s; no restart left", self.kind, self.url, code)
                return
            self.restarts += 1
            log.warning(
                "%s at %s exited with %s; restart %d", self.kind, self.url, code, self.restarts
            )
            await self._kill()  # the processes it started may linger
            try:
                await self._spawn(startup_s)
            except (RuntimeError, TimeoutError):
                log.exception("%s restart failed", self.kind)

    @property
    def pid(self) -> int | None:
        """The server's process id, which is also its process group (its children are in it)."""
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    async def stop(self) -> None:
        self._stopping = True
        await self._kill()
        if self._watch is not None:
            await asyncio.gather(self._watch, return_exceptions=True)

    async def _kill(self, grace: float = 30) -> None:
        """SIGTERM to the server's process group, SIGKILL to whatever is left after `grace`."""
        proc = self._proc
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + grace
            while loop.time() < deadline:
                os.killpg(proc.pid, 0)  # raises once no process of the group is left
                proc.poll()
                await asyncio.sleep(0.2)
            os.killpg(proc.pid, signal.SIGKILL)
        await asyncio.to_thread(proc.wait)

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""
