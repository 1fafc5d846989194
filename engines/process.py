"""`ProcessEngine`: the local engine in a process of its own, behind the same `Engine` protocol.

In one process, the engine's worker thread (Python between torch kernels) and the gateway's event
loop (HTTP, chat templates, SQL) take turns on one GIL, so each slows the other. Here the engine
runs in a child process (`engines.process_main`), as vLLM separates its API server from its engine
core; this side keeps only what the gateway needs to be fast and correct without asking the child:

- `generate` checks the request here (the same `check_request` as the local engine), so bad input
  raises before the first chunk; tokens come back as one message per decode step, fanned out to
  each consumer's event loop in one callback per loop.
- `version()` and `stats` mirror the child's, updated by every step and every weight swap.
- `update_weights` with a state dict copies it once into shared memory (`engines.ipc.WeightStage`)
  and sends only the layout; a directory is sent by path.
- If the child dies, every live stream and pending call fails with `EngineUnavailableError` (the
  gateway answers 503), and so does every later call.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import subprocess
import sys
import threading
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engines.base import (
    EngineHealth,
    FinishReason,
    GenerateRequest,
    TokenChunk,
    WeightUpdate,
    check_request,
)
from engines.errors import (
    EngineUnavailableError,
    InvalidRequestError,
    WeightUpdateError,
)
from engines.ipc import (
    SOCKET_BUFFER,
    Abort,
    Control,
    ErrorKind,
    FrameReader,
    LoadWeights,
    Ready,
    Reply,
    Start,
    StartFailed,
    Step,
    Submit,
    ToEngine,
    WeightStage,
    frame,
)

if TYPE_CHECKING:
    from engines.local import EngineStats, LocalEngineConfig

log = logging.getLogger(__name__)

_Item = TokenChunk | BaseException


def default_threads() -> int:
    """Torch threads for the engine process: every core this process may use but one, which is
    left to the gateway's event loop (HTTP, chat templates, the commit). On 2 idle cores the
    engine with 1 thread gave the gateway 1.46x the throughput it had with 2 threads on the tiny
    model (64 clients) and 1.10x on the demo model; with 2 threads the engine's threads and the
    event loop take turns on the cores (BENCHMARKS.md)."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


@dataclass(eq=False, slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[_Item]


def _error(kind: ErrorKind, message: str) -> Exception:
    if kind == "weight_update":
        return WeightUpdateError(message)
    if kind == "invalid":
        return InvalidRequestError(message)
    return EngineUnavailableError(message)


class ProcessEngine:
    """Implements `engines.base.Engine` with a `LocalEngine` in a child process. Build with
    `ProcessEngine.load(config)`; `close()` stops the child."""

    def __init__(
        self,
        proc: subprocess.Popen[bytes],
        sock: socket.socket,
        ready: Ready,
        config: LocalEngineConfig,
    ) -> None:
        from engines.local import EngineStats

        self.config = config
        self.pid = proc.pid
        self.eos_token_ids = ready.eos_token_ids
        self.max_model_len = ready.max_model_len
        self.vocab_size = ready.vocab_size
        self.threads = ready.threads
        self.stats: EngineStats = EngineStats()
        """The child's batching counters as of its last step."""
        self._proc = proc
        self._sock = sock
        self._version = ready.version
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._live: dict[str, _Stream] = {}
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]]] = {}
        self._call_ids = itertools.count()
        self._failure: str | None = None
        self._closing = False
        self._stage = WeightStage()
        self._update_lock = asyncio.Lock()
        self._reader = threading.Thread(
            target=self._read, name="rlgateway-engine-reader", daemon=True
        )
        self._reader.start()

    @classmethod
    def load(cls, config: LocalEngineConfig, *, threads: int | None = None) -> ProcessEngine:
        """Start the engine process and wait until its model is loaded. `threads`: torch threads
        in the child (default `default_threads()`). Raises `ValueError` for a bad config and
        `EngineUnavailableError` if the child fails otherwise."""
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
        try:
            ours.sendall(frame(Start(config, threads or default_threads())))
            msg = next(iter(FrameReader(ours).read()))
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
        return cls(proc, ours, msg, config)

    # -- the Engine protocol -----------------------------------------------------------------

    def version(self) -> int:
        return self._version

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        check_request(request, max_model_len=self.max_model_len, vocab_size=self.vocab_size)
        return self._stream(request)

    async def _stream(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        rid = request.request_id
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            self._check_open()
            if rid in self._live:
                raise InvalidRequestError(f"request id {rid!r} is already live")
            self._live[rid] = stream
        finished = False
        try:
            self._send(Submit(request))
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finish_reason is not None
                yield item
        finally:
            if not finished:
                await self.abort(rid)

    async def abort(self, request_id: str) -> None:
        with self._lock:
            live = request_id in self._live and self._failure is None and not self._closing
        if live:
            with contextlib.suppress(EngineUnavailableError):  # gone already: nothing to abort
                self._send(Abort(request_id))

    async def pause(self) -> None:
        await self._call(lambda call_id: Control(call_id, "pause"))

    async def resume(self) -> None:
        await self._call(lambda call_id: Control(call_id, "resume"))

    async def update_weights(self, update: WeightUpdate) -> int:
        async with self._update_lock:  # one staged state dict at a time
            if update.path is not None:
                path = str(update.path.resolve())
                version: int = await self._call(
                    lambda call_id: LoadWeights(call_id, update.version, path=path)
                )
                return version
            assert update.state_dict is not None
            shared = await asyncio.to_thread(self._stage.stage, update.state_dict)
            try:
                version = await self._call(
                    lambda call_id: LoadWeights(call_id, update.version, shared=shared)
                )
            except WeightUpdateError:
                self._stage.mapped()  # refused after the child mapped the file
                raise
            except BaseException:
                self._stage.close()  # the child may not have mapped it: start afresh next time
                raise
            self._stage.mapped()
            return version

    async def health(self) -> EngineHealth:
        with self._lock:
            failure = self._failure or ("closed" if self._closing else None)
        if failure is not None:
            return EngineHealth(
                ok=False, paused=False, version=self._version, running=0, waiting=0, detail=failure
            )
        health: EngineHealth = await self._call(lambda call_id: Control(call_id, "health"))
        return health

    async def close(self) -> None:
        """Abort every live request, stop the child and wait for it. Idempotent."""
        with self._lock:
            closing, self._closing = self._closing, True
            alive = self._failure is None
        if closing:
            return
        if alive:
            with contextlib.suppress(EngineUnavailableError):
                await self._call(lambda call_id: Control(call_id, "close"), closing=True)
        await asyncio.to_thread(self._stop)

    def _stop(self) -> None:
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            log.warning("the engine process (pid %d) did not exit; killing it", self.pid)
            self._proc.kill()
            self._proc.wait()
        self._reader.join(timeout=30)
        self._sock.close()
        self._stage.close()

    # -- talking to the child ------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._failure is not None:
            raise EngineUnavailableError(self._failure)
        if self._closing:
            raise EngineUnavailableError("the engine process is closed")

    def _send(self, msg: ToEngine) -> None:
        data = frame(msg)
        try:
            with self._send_lock:
                self._sock.sendall(data)
        except OSError as exc:
            raise EngineUnavailableError(f"the engine process is gone: {exc}") from exc

    async def _call(self, make: Callable[[int], ToEngine], *, closing: bool = False) -> Any:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        with self._lock:
            if self._failure is not None or (self._closing and not closing):
                self._check_open()
            call_id = next(self._call_ids)
            self._calls[call_id] = (loop, future)
        try:
            self._send(make(call_id))
        except BaseException:
            with self._lock:
                self._calls.pop(call_id, None)
            raise
        return await future

    def _read(self) -> None:
        """The reader thread: dispatch the child's messages until its end closes. It takes
        whatever has arrived in one read, so a busy event loop (holding the GIL) costs it one
        GIL hand-over per batch of steps, not one per step."""
        reader = FrameReader(self._sock)
        try:
            while True:
                for msg in reader.read():
                    if isinstance(msg, Step):
                        self._on_step(msg)
                    elif isinstance(msg, Reply):
                        self._on_reply(msg)
                    else:
                        raise TypeError(f"unexpected message {type(msg).__name__}")
        except (EOFError, OSError):
            pass
        except BaseException:
            log.exception("the engine reader failed")
        finally:
            self._on_exit()

    def _on_step(self, msg: Step) -> None:
        self._version = msg.version
        self.stats = msg.stats
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[_Item], _Item]]] = (
            defaultdict(list)
        )
        with self._lock:
            live = self._live
            for rid, ids, logprobs, versions, finish, tops in msg.chunks:
                stream = live.get(rid) if finish is None else live.pop(rid, None)
                if stream is not None:
                    reason = FinishReason(finish) if finish is not None else None
                    chunk = TokenChunk(ids, logprobs, versions, reason, tops)
                    by_loop[stream.loop].append((stream.queue, chunk))
            for rid, message in msg.errors:
                stream = live.pop(rid, None)
                if stream is not None:
                    by_loop[stream.loop].append((stream.queue, EngineUnavailableError(message)))
        _post(by_loop)

    def _on_reply(self, msg: Reply) -> None:
        with self._lock:
            loop, future = self._calls.pop(msg.call_id)
        result: Any = msg.value
        if msg.error is not None:
            result = _error(*msg.error)
        elif isinstance(msg.value, int):  # a weight swap's new version
            self._version = msg.value
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_settle, future, result)

    def _on_exit(self) -> None:
        code = self._proc.wait()
        with self._lock:
            if self._closing:
                failure = "the engine process is closed"
            else:
                failure = f"the engine process (pid {self.pid}) exited with code {code}"
                log.error("%s", failure)
            self._failure = failure
            streams, self._live = list(self._live.values()), {}
            calls, self._calls = list(self._calls.values()), {}
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[_Item], _Item]]] = (
            defaultdict(list)
        )
        for stream in streams:
            by_loop[stream.loop].append((stream.queue, EngineUnavailableError(failure)))
        _post(by_loop)
        for loop, future in calls:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_settle, future, EngineUnavailableError(failure))


def _post(
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[_Item], _Item]]],
) -> None:
    for loop, items in by_loop.items():
        # A closed loop raises RuntimeError: its consumer is gone and nobody is listening.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[asyncio.Queue[_Item], _Item]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def _settle(future: asyncio.Future[Any], result: Any) -> None:
    if future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)
