"""The supervision of `ProcessEngine`'s engine process, apart from the client that talks to it.

`Supervisor` keeps one child up: a reader thread per child hands each message to the client
(`dispatch`); when the child dies (a crash, `kill -9`, the OOM killer, its engine failing) it
fails every stream and call in flight on it with `EngineUnavailableError` (with `retry_after`),
then starts a new one after a backoff (`RestartBudget`, from `RestartPolicy`) with the client's
`start` (which gives it the current weights) until one is up, the policy gives up, or the engine
closes. `down` says why none is serving meanwhile. `lock` guards the child and what is in flight
on it; the client takes it too.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import subprocess
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engines.errors import EngineUnavailableError
from engines.ipc import Reply, Step
from engines.process_child import Child, Item, RestartPolicy

log = logging.getLogger("engines.process")


@dataclass(slots=True)
class RestartBudget:
    """The deaths counted within the policy's window, and the backoff they earn. Pure: the
    caller passes the clock."""

    policy: RestartPolicy
    deaths: collections.deque[float] = field(default_factory=collections.deque)

    def next_delay(self, now: float) -> float | None:
        """Count a death at `now`: the seconds to wait before the next start, or None when the
        policy allows no more within its window (the death is then not counted)."""
        while self.deaths and now - self.deaths[0] > self.policy.window_s:
            self.deaths.popleft()
        if len(self.deaths) >= self.policy.max_restarts:
            return None
        delay = min(self.policy.backoff_s * 2.0 ** len(self.deaths), self.policy.max_backoff_s)
        self.deaths.append(now)
        return delay


class Supervisor:
    def __init__(
        self,
        child: Child,
        *,
        policy: RestartPolicy,
        start_s: float,
        start: Callable[[], Child],
        dispatch: Callable[[Child, Step | Reply], None],
        on_up: Callable[[Child], None],
    ) -> None:
        self.lock = threading.Lock()
        self.child: Child | None = child
        self.pid = child.pid
        """The engine process's pid (the newest one's, after a restart)."""
        self.restarts = 0
        """Engine processes started after one died."""
        self.down: str | None = None
        """Why the engine is not serving (None while a child is up)."""
        self.closing = False
        self._retry_at: float | None = None
        """When (monotonic) a new child is expected to be up; None when none is coming."""
        self._budget = RestartBudget(policy)
        self._start_s = start_s
        """How long the last start took: what a restart is expected to take."""
        self._start = start
        self._dispatch = dispatch
        self._on_up = on_up
        self._wake = threading.Event()
        """Set by `close`: a restart waiting out its backoff gives up."""
        self._readers: list[threading.Thread] = []

    def start(self) -> None:
        """Start reading the first child (once the client can take its messages)."""
        assert self.child is not None
        self._watch(self.child)

    def up(self) -> Child:
        """The child now serving, or `EngineUnavailableError` saying why there is none. Called
        with `lock` held."""
        if self.closing:
            raise EngineUnavailableError("the engine process is closed")
        if self.child is None:
            assert self.down is not None
            raise EngineUnavailableError(self.down, retry_after=self.retry_after())
        return self.child

    def retry_after(self) -> float | None:
        if self._retry_at is None:
            return None
        return max(1.0, self._retry_at - time.monotonic())

    def begin_close(self) -> tuple[bool, Child | None]:
        """Mark the engine closing (no restart from now on); whether it already was, and the
        child serving now."""
        with self.lock:
            closing, self.closing = self.closing, True
            child = self.child
        self._wake.set()
        return closing, child

    def stop(self) -> None:
        """Wait for the child to exit (kill it after 30 s) and for every reader to finish."""
        with self.lock:
            child = self.child
        if child is not None:
            try:
                child.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                log.warning("the engine process (pid %d) did not exit; killing it", child.pid)
                child.proc.kill()
        for reader in list(self._readers):  # a reader that restarts a child may add one
            reader.join(timeout=60)

    # -- the reader threads --------------------------------------------------------------------

    def _watch(self, child: Child) -> None:
        reader = threading.Thread(
            target=self._read, args=(child,), name="rlgateway-engine-reader", daemon=True
        )
        self._readers.append(reader)
        reader.start()

    def _read(self, child: Child) -> None:
        """The reader thread of `child`: dispatch its messages until its end closes, then fail
        what was in flight on it and, unless closing, start a new child. It takes whatever has
        arrived in one read, so a busy event loop (holding the GIL) costs it one GIL hand-over
        per batch of steps, not one per step."""
        try:
            while True:
                for msg in child.frames.read():
                    if not isinstance(msg, Step | Reply):
                        raise TypeError(f"unexpected message {type(msg).__name__}")
                    self._dispatch(child, msg)
        except (EOFError, OSError):
            pass
        except BaseException:
            log.exception("the engine reader failed; stopping its engine process")
            with contextlib.suppress(ProcessLookupError):
                child.proc.kill()
        delay = self._on_exit(child)
        if delay is not None:
            self._restart_after(delay)

    def _on_exit(self, child: Child) -> float | None:
        """`child` is gone: fail what it held; return the backoff before a restart, or None
        when there is to be none (closing, or too many deaths)."""
        code = child.proc.wait()
        child.sock.close()
        with self.lock:
            if self.child is child:
                self.child = None
            delay = None
            if self.closing:
                reason = "the engine process is closed"
                self.down = reason
            else:
                reason = f"the engine process (pid {child.pid}) exited with code {code}"
                delay = self._plan_restart(reason)
                log.error("%s", self.down)
            retry_after = self.retry_after()
            streams, child.live = list(child.live.values()), {}
            calls, child.calls = list(child.calls.values()), {}
        error = self.down or reason
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Item], Item]]] = (
            defaultdict(list)
        )
        for stream in streams:
            by_loop[stream.loop].append(
                (stream.queue, EngineUnavailableError(error, retry_after=retry_after))
            )
        post(by_loop)
        for call in calls:
            with contextlib.suppress(RuntimeError):
                call.loop.call_soon_threadsafe(
                    settle, call.future, EngineUnavailableError(error, retry_after=retry_after)
                )
        return delay

    def _plan_restart(self, reason: str) -> float | None:
        """Count a death (or a failed start) and set `down`; the backoff before the next start,
        or None when the policy allows no more. Called with `lock` held."""
        now = time.monotonic()
        delay = self._budget.next_delay(now)
        if delay is None:
            policy = self._budget.policy
            self.down = (
                f"{reason}; it died {len(self._budget.deaths) + 1} times within "
                f"{policy.window_s:.0f} s, so it is not started again: restart the gateway"
            )
            self._retry_at = None
            return None
        self.down = f"{reason}; restarting it (restart {self.restarts + 1})"
        self._retry_at = now + delay + self._start_s
        return delay

    def _restart_after(self, delay: float) -> None:
        """Start new children until one is up (with the current weights), the policy gives up,
        or the engine closes."""
        while not self._wake.wait(delay):
            started = time.monotonic()
            try:
                child = self._start()
            except Exception as exc:
                log.exception("restarting the engine process failed")
                with self.lock:
                    next_delay = self._plan_restart(f"restarting the engine process failed: {exc}")
                if next_delay is None:
                    log.error("%s", self.down)
                    return
                delay = next_delay
                continue
            with self.lock:
                closing = self.closing
                if not closing:
                    self._start_s = time.monotonic() - started
                    self.child = child
                    self.down = None
                    self._retry_at = None
                    self.restarts += 1
                    self.pid = child.pid
                    self._on_up(child)
            if closing:
                child.kill()
                return
            log.warning(
                "the engine process was restarted (pid %d, version %d, restart %d)",
                child.pid,
                child.ready.version,
                self.restarts,
            )
            self._watch(child)
            return


def post(
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Item], Item]]],
) -> None:
    """Each event loop's items onto their queues, in one callback per loop."""
    for loop, items in by_loop.items():
        # A closed loop raises RuntimeError: its consumer is gone and nobody is listening.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[asyncio.Queue[Item], Item]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def settle(future: asyncio.Future[Any], result: Any) -> None:
    """Resolve `future` with `result` (an exception is raised by it), unless it already is."""
    if future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)
