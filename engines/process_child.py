"""The engine process itself, as `ProcessEngine` holds it: how one is started (`spawn`), its
socket and what is in flight on it (`Child`), which weights a new one must get (`Applied`), and
when a dead one is started again (`RestartPolicy`)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engines.base import TokenChunk
from engines.errors import EngineUnavailableError
from engines.ipc import (
    SOCKET_BUFFER,
    FrameReader,
    Ready,
    Reply,
    Start,
    StartFailed,
    ToEngine,
    frame,
)

if TYPE_CHECKING:
    from engines.local import LocalEngineConfig

Item = TokenChunk | BaseException
"""What a stream's queue carries: its next chunk, or the error that ends it."""


def default_threads() -> int:
    """Torch threads for the engine process: every core this process may use but one, which is
    left to the gateway's event loop (HTTP, chat templates, the commit). On 2 idle cores the
    engine with 1 thread gave the gateway 1.46x the throughput it had with 2 threads on the tiny
    model (64 clients) and 1.10x on the demo model; with 2 threads the engine's threads and the
    event loop take turns on the cores (BENCHMARKS.md)."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


@dataclass(frozen=True, slots=True, kw_only=True)
class RestartPolicy:
    """When a dead engine process is started again."""

    max_restarts: int = 5
    """Restarts within `window_s`; the engine stays down after one more death in the window."""
    window_s: float = 600.0
    """Seconds over which deaths are counted."""
    backoff_s: float = 0.5
    """Seconds before the first restart in the window, doubled for each further one."""
    max_backoff_s: float = 30.0
    """The longest wait before a restart."""


@dataclass(eq=False, slots=True)
class Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Item]


@dataclass(eq=False, slots=True)
class PendingCall:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]
    on_success: Callable[[Any], None] | None = None
    """Run on the reader thread with the reply's value before the caller sees it (so that what
    a weight swap changed is recorded before a death that follows it can start a restart)."""


@dataclass(frozen=True, slots=True)
class Applied:
    """The weights a new engine process must be given: a directory (`path`) or the state dict
    the stage keeps (`path` None), at `version`."""

    version: int
    path: str | None


class Child:
    """One engine process, its socket, and the streams and calls in flight on it."""

    def __init__(
        self, proc: subprocess.Popen[bytes], sock: socket.socket, frames: FrameReader, ready: Ready
    ) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.sock = sock
        self.frames = frames
        """Reads `sock`; it may hold messages already read past `ready`."""
        self.ready = ready
        self.live: dict[str, Sink] = {}
        self.calls: dict[int, PendingCall] = {}
        self._send_lock = threading.Lock()

    def send(self, msg: ToEngine) -> None:
        data = frame(msg)
        try:
            with self._send_lock:
                self.sock.sendall(data)
        except OSError as exc:
            raise EngineUnavailableError(f"the engine process is gone: {exc}") from exc

    def ask(self, msg: ToEngine) -> Reply:
        """Send `msg` and wait for its reply, before any reader thread runs (a new child)."""
        self.send(msg)
        reply = next(iter(self.frames.read()))
        assert isinstance(reply, Reply), f"expected Reply, got {type(reply).__name__}"
        return reply

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.proc.wait()
        self.sock.close()


def spawn(config: LocalEngineConfig, threads: int) -> Child:
    """Start an engine process and wait until its model is loaded. Raises `ValueError` for a bad
    config and `EngineUnavailableError` if the child fails otherwise."""
    ours, theirs = socket.socketpair()
    for s in (ours, theirs):  # room for many steps, so the engine never waits on the gateway
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
    # The child imports `engines` from wherever this process did, installed or not.
    root = str(Path(__file__).resolve().parent.parent)
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    with theirs:
        proc = subprocess.Popen(
            [sys.executable, "-m", "engines.process_main", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            env={**os.environ, "PYTHONPATH": path},
        )
    frames = FrameReader(ours)
    try:
        ours.sendall(frame(Start(config, threads)))
        msg = next(iter(frames.read()))
    except (EOFError, OSError) as exc:
        ours.close()
        code = proc.wait()
        raise EngineUnavailableError(
            f"the engine process exited with code {code} while loading {config.model}"
        ) from exc
    if isinstance(msg, StartFailed):
        ours.close()
        proc.wait()
        if msg.kind == "value":
            raise ValueError(f"the engine process could not load the model: {msg.message}")
        raise EngineUnavailableError(
            f"the engine process could not load {config.model}: {msg.message}"
        )
    assert isinstance(msg, Ready), f"expected Ready, got {type(msg).__name__}"
    return Child(proc, ours, frames, msg)
