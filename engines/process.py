"""`ProcessEngine`: the local engine in a process of its own, behind the same `Engine` protocol,
restarted when it dies.

In one process, the engine's worker thread (Python between torch kernels) and the gateway's event
loop (HTTP, chat templates, SQL) take turns on one GIL, so each slows the other. Here the engine
runs in a child process (`engines.process_main`), as vLLM separates its API server from its engine
core; this side keeps only what the gateway needs to be fast and correct without asking the child:

- `generate` checks the request here (`engines.limits.check_local_request`, as the local engine
  does), so bad input raises before the first chunk; tokens come back as one message per decode
  step, fanned out to each consumer's event loop in one callback per loop.
- `version()` and `stats` mirror the child's, updated by every step and every weight swap.
- `update_weights` with a state dict copies it once into shared memory (`engines.ipc.WeightStage`)
  and sends only the layout; a directory is sent by path.

Supervision (`engines.process_supervisor`, apart from this client): when the child dies (a crash,
`kill -9`, the OOM killer, or its engine failing), every live stream and pending call fails with
`EngineUnavailableError` (the gateway answers 503, with `Retry-After` from the error's
`retry_after`), and so does every call until a new child is up. The reader thread of the dead
child then starts a new one itself, after a backoff (`RestartPolicy`), with the current weights:
the last update that was applied (a directory by its path, a state dict from the copy the stage
keeps) at its version, and paused if the engine was (`_start_child`). More deaths than the policy
allows within its window and the engine stays down. `health()` says why while it is down, and
counts the restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from engines.base import (
    EngineHealth,
    FinishReason,
    GenerateRequest,
    TokenChunk,
    WeightUpdate,
)
from engines.errors import (
    EngineUnavailableError,
    InvalidRequestError,
    RequestFailedError,
    WeightUpdateError,
)
from engines.ipc import (
    Abort,
    Control,
    ErrorKind,
    LoadWeights,
    Reply,
    SharedWeights,
    Step,
    Submit,
    ToEngine,
    WeightStage,
    unlink,
)
from engines.limits import check_local_request
from engines.process_child import (
    Applied,
    Child,
    Item,
    PendingCall,
    RestartPolicy,
    Sink,
    default_threads,
    spawn,
)
from engines.process_supervisor import Supervisor, post, settle

if TYPE_CHECKING:
    from engines.local import LocalEngineConfig
    from engines.local_worker import EngineStats

log = logging.getLogger(__name__)


def _error(kind: ErrorKind, message: str, retry_after: float | None = None) -> Exception:
    if kind == "weight_update":
        return WeightUpdateError(message)
    if kind == "invalid":
        return InvalidRequestError(message)
    if kind == "failed":
        return RequestFailedError(message, retry_after=retry_after)
    return EngineUnavailableError(message, retry_after=retry_after)


class ProcessEngine:
    """Implements `engines.base.Engine` with a `LocalEngine` in a child process that is started
    again when it dies. Build with `ProcessEngine.load(config)`; `close()` stops the child."""

    def __init__(
        self,
        child: Child,
        config: LocalEngineConfig,
        *,
        threads: int,
        restart: RestartPolicy,
        start_s: float,
    ) -> None:
        from engines.local_worker import EngineStats

        ready = child.ready
        self.config = config
        self.restart = restart
        self.eos_token_ids = ready.eos_token_ids
        self.max_model_len = ready.max_model_len
        self.vocab_size = ready.vocab_size
        self.threads = ready.threads
        self.stats: EngineStats = EngineStats()
        """The child's batching counters as of its last step (a new child starts from zero)."""
        self._threads_asked = threads
        self._version = ready.version
        self._paused = False
        self._applied: Applied | None = None
        self._call_ids = itertools.count()
        self._stage = WeightStage()
        self._update_lock = asyncio.Lock()
        self._sup = Supervisor(
            child,
            policy=restart,
            start_s=start_s,
            start=self._start_child,
            dispatch=self._dispatch,
            on_up=self._on_up,
        )
        self._lock = self._sup.lock
        self._sup.start()

    @classmethod
    def load(
        cls,
        config: LocalEngineConfig,
        *,
        threads: int | None = None,
        restart: RestartPolicy | None = None,
    ) -> ProcessEngine:
        """Start the engine process and wait until its model is loaded. `threads`: torch threads
        in the child (default `default_threads()`); `restart`: when a dead child is started
        again (default `RestartPolicy()`). Raises `ValueError` for a bad config and
        `EngineUnavailableError` if the child fails otherwise."""
        threads = threads or default_threads()
        started = time.monotonic()
        child = spawn(config, threads)
        return cls(
            child,
            config,
            threads=threads,
            restart=restart or RestartPolicy(),
            start_s=time.monotonic() - started,
        )

    @property
    def pid(self) -> int:
        """The engine process's pid (the newest one's, after a restart)."""
        return self._sup.pid

    @property
    def restarts(self) -> int:
        """Engine processes started after one died."""
        return self._sup.restarts

    # -- the Engine protocol -----------------------------------------------------------------

    def version(self) -> int:
        return self._version

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        check_local_request(request, max_model_len=self.max_model_len, vocab_size=self.vocab_size)
        return self._stream(request)

    async def _stream(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        rid = request.request_id
        stream = Sink(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            child = self._sup.up()
            if rid in child.live:
                raise InvalidRequestError(f"request id {rid!r} is already live")
            child.live[rid] = stream
        finished = False
        try:
            child.send(Submit(request))
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
            child = self._sup.child
            live = child is not None and request_id in child.live and not self._sup.closing
        if live:
            assert child is not None
            with contextlib.suppress(EngineUnavailableError):  # gone already: nothing to abort
                child.send(Abort(request_id))

    async def pause(self) -> None:
        await self._call(lambda call_id: Control(call_id, "pause"))
        self._paused = True

    async def resume(self) -> None:
        await self._call(lambda call_id: Control(call_id, "resume"))
        self._paused = False

    async def update_weights(self, update: WeightUpdate) -> int:
        async with self._update_lock:  # one staged state dict at a time
            if update.path is not None:
                path = str(update.path.resolve())

                def applied_dir(version: int) -> None:
                    self._set_applied(Applied(version, path))
                    self._stage.drop_applied()

                version: int = await self._call(
                    lambda call_id: LoadWeights(call_id, update.version, path=path),
                    on_success=applied_dir,
                )
                return version
            assert update.state_dict is not None
            shared = await asyncio.to_thread(self._stage.stage, update.state_dict)

            def applied_state(version: int) -> None:
                self._stage.commit()
                self._set_applied(Applied(version, None))

            try:
                version = await self._call(
                    lambda call_id: LoadWeights(call_id, update.version, shared=shared),
                    on_success=applied_state,
                )
            finally:
                self._stage.discard()  # refused or lost (a no-op once committed)
            return version

    async def health(self) -> EngineHealth:
        with self._lock:
            up = self._sup.child is not None and not self._sup.closing
        if up:
            try:
                health: EngineHealth = await self._call(lambda call_id: Control(call_id, "health"))
                return dataclasses.replace(health, restarts=self.restarts)
            except EngineUnavailableError:
                pass  # it died during the call: report it down
        with self._lock:
            if self._sup.down is not None:
                detail = self._sup.down
            elif self._sup.closing:
                detail = "the engine process is closed"
            else:  # it died under this call; its exit is being handled (then `down` says how)
                detail = f"the engine process (pid {self.pid}) is gone"
        return EngineHealth(
            ok=False,
            paused=self._paused,
            version=self._version,
            running=0,
            waiting=0,
            detail=detail,
            restarts=self.restarts,
        )

    async def close(self) -> None:
        """Abort every live request, stop the child (and any restart) and wait. Idempotent."""
        closing, child = self._sup.begin_close()
        if closing:
            return
        if child is not None:
            with contextlib.suppress(EngineUnavailableError):
                await self._call(lambda call_id: Control(call_id, "close"), closing=True)
        await asyncio.to_thread(self._stop)

    def _stop(self) -> None:
        self._sup.stop()
        self._stage.close()

    # -- talking to the child ------------------------------------------------------------------

    def _set_applied(self, applied: Applied) -> None:
        with self._lock:
            self._applied = applied

    async def _call(
        self,
        make: Callable[[int], ToEngine],
        *,
        closing: bool = False,
        on_success: Callable[[Any], None] | None = None,
    ) -> Any:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        with self._lock:
            child = self._sup.child if closing and self._sup.child is not None else self._sup.up()
            call_id = next(self._call_ids)
            child.calls[call_id] = PendingCall(loop, future, on_success)
        try:
            child.send(make(call_id))
        except BaseException:
            with self._lock:
                child.calls.pop(call_id, None)
            raise
        return await future

    def _dispatch(self, child: Child, msg: Step | Reply) -> None:
        """A message of `child`, on its reader thread."""
        if isinstance(msg, Step):
            self._on_step(child, msg)
        else:
            self._on_reply(child, msg)

    def _on_step(self, child: Child, msg: Step) -> None:
        self._version = msg.version
        self.stats = msg.stats
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Item], Item]]] = (
            defaultdict(list)
        )
        with self._lock:
            live = child.live
            for rid, ids, logprobs, versions, finish, tops in msg.chunks:
                stream = live.get(rid) if finish is None else live.pop(rid, None)
                if stream is not None:
                    reason = FinishReason(finish) if finish is not None else None
                    chunk = TokenChunk(ids, logprobs, versions, reason, tops)
                    by_loop[stream.loop].append((stream.queue, chunk))
            for rid, kind, message, retry_after in msg.errors:
                stream = live.pop(rid, None)
                if stream is not None:
                    by_loop[stream.loop].append((stream.queue, _error(kind, message, retry_after)))
        post(by_loop)

    def _on_reply(self, child: Child, msg: Reply) -> None:
        with self._lock:
            call = child.calls.pop(msg.call_id)
        result: Any = msg.value
        if msg.error is not None:
            result = _error(*msg.error)
        else:
            if isinstance(msg.value, int):  # a weight swap's new version
                self._version = msg.value
            if call.on_success is not None:
                call.on_success(msg.value)
        with contextlib.suppress(RuntimeError):
            call.loop.call_soon_threadsafe(settle, call.future, result)

    def _on_up(self, child: Child) -> None:
        """A new child serves (the supervisor's lock held): its version is the engine's."""
        self._version = child.ready.version

    def _start_child(self) -> Child:
        """A new child on the current weights and version, paused if the engine is."""
        from engines.local_worker import EngineStats

        child = spawn(self.config, self._threads_asked)
        with self._lock:
            applied, paused = self._applied, self._paused
        shared: SharedWeights | None = None
        try:
            if applied is not None:
                if applied.path is None:
                    shared = self._stage.restage()
                    assert shared is not None, "a state dict was applied but is not kept"
                reply = child.ask(
                    LoadWeights(-1, applied.version, shared=shared, path=applied.path)
                )
                if reply.error is not None:
                    raise EngineUnavailableError(
                        f"the new engine process refused the current weights (version "
                        f"{applied.version}): {reply.error[1]}"
                    )
                child.ready = dataclasses.replace(child.ready, version=applied.version)
            if paused:
                child.ask(Control(-1, "pause"))
        except BaseException:
            child.kill()
            raise
        finally:
            if shared is not None:
                unlink(shared)
        self.stats = EngineStats()
        return child
