"""The user's reward function: found by name, then run off the event loop under a timeout.

A reward function is `fn(prompt: str, completion: str, row: dict) -> float | int | bool`, plain
or `async def`; `row` is the dataset row (after the spec's field mapping). `resolve_reward`
finds it from a spec's string: a built-in (`graders.GRADERS`), `package.module:function`, or
`path/to/file.py:function` (relative to the spec's folder).

`RewardRunner` calls it and never raises: every call ends as a `RewardOutcome`, `ok` with a
finite value, or `error` (it raised), `timeout`, or `invalid` (it returned something that is not
a finite number). Async functions run on the event loop. Sync functions run in a pool, at most
`max_workers` at once, the timeout counting from when one starts (not while it waits its turn):

- `thread` (the default): a thread pool. A thread cannot be killed, so a call that times out
  keeps running and keeps its thread; `max_workers` of them hung leave none for the next calls,
  which then time out too (and the interpreter waits for them at exit). Use `process` for a
  grader that can hang.
- `process`: one worker process per slot (started with `forkserver`: safe in a process that has
  threads, and each worker imports the function's module once). A call that times out has its
  worker killed and replaced, so a hanging grader cannot exhaust the pool. The function must
  pickle (a module-level function of an importable module, or a `file.py:function` reference),
  checked when the runner is built; arguments and the value cross a pipe.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import math
import multiprocessing
import numbers
import pickle
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Literal, cast

from rlgateway.experiment.graders import GRADERS
from rlgateway.experiment.imports import load_file

Row = dict[str, Any]
RewardFn = Callable[[str, str, Row], Any]
"""`fn(prompt, completion, row) -> float | int | bool`, or an `async def` returning one."""
Status = Literal["ok", "error", "timeout", "invalid"]
STATUSES: tuple[Status, ...] = ("ok", "error", "timeout", "invalid")


class RewardError(ValueError):
    """A reward reference that does not name a usable function; the message says what to fix."""


@dataclass(frozen=True)
class RewardOutcome:
    """How one grading ended. `value` is a finite float exactly when `status` is `ok`; `detail`
    is the exception (`ValueError: ...`), the timeout, or why the value is invalid."""

    value: float | None
    status: Status
    detail: str = ""


def resolve_reward(ref: str | RewardFn, *, base_dir: Path | None = None) -> RewardFn:
    """The reward function `ref` names (module docstring). A callable is returned as it is.
    Raises `RewardError` naming what is missing."""
    if callable(ref):
        return _checked(ref, repr(ref))
    if ref in GRADERS:
        return GRADERS[ref]
    where, colon, name = ref.rpartition(":")
    if not colon or not where or not name:
        raise RewardError(
            f"reward {ref!r} is not a built-in ({', '.join(GRADERS)}) and not a reference to a "
            "function: write `package.module:function` or `path/to/file.py:function`"
        )
    if where.endswith(".py") or "/" in where:
        path = Path(where).expanduser()
        if not path.is_absolute():
            path = (base_dir or Path.cwd()) / path
        if not path.is_file():
            raise RewardError(f"reward {ref!r}: file not found: {path}")
        fn = _attribute(_load_file(path, ref), name, ref, str(path))
        if _is_async(fn):
            return fn
        # a sync function may run in a process pool, so it travels as its file and name: the
        # worker loads the file itself (a module loaded from a path cannot be imported by name)
        _FILE_FUNCTIONS[(str(path), name)] = fn
        return FileFunction(path, name)
    try:
        module = importlib.import_module(where)
    except ImportError as exc:
        raise RewardError(
            f"reward {ref!r}: cannot import module {where!r} ({type(exc).__name__}: {exc}); "
            f"for a file next to the spec, write `{where.replace('.', '/')}.py:{name}`"
        ) from None
    return _attribute(module, name, ref, f"module {where!r}")


@dataclass(frozen=True)
class FileFunction:
    """A sync reward function defined in a Python file, called through its path and name: it
    pickles as the two, so a process worker loads the file itself on its first call."""

    path: Path
    name: str

    def __call__(self, prompt: str, completion: str, row: Row) -> Any:
        key = (str(self.path), self.name)
        fn = _FILE_FUNCTIONS.get(key)
        if fn is None:
            ref = f"{self.path}:{self.name}"
            module = _load_file(self.path, ref)
            fn = _FILE_FUNCTIONS[key] = _attribute(module, self.name, ref, str(self.path))
        return fn(prompt, completion, row)


_FILE_FUNCTIONS: dict[tuple[str, str], RewardFn] = {}


class RewardRunner:
    """Runs a reward function under a timeout and never raises (module docstring). `counts` is
    how many calls ended in each status. Call `close()` when done."""

    def __init__(
        self,
        fn: RewardFn,
        *,
        timeout: float = 15.0,
        executor: Literal["thread", "process"] = "thread",
        max_workers: int = 4,
    ) -> None:
        if timeout <= 0 or max_workers < 1:
            raise RewardError("a reward runner needs timeout > 0 and max_workers >= 1")
        self.fn = fn
        self.timeout = timeout
        self.counts: dict[str, int] = dict.fromkeys(STATUSES, 0)
        self._async = _is_async(fn)
        self._slots = asyncio.Semaphore(max_workers)
        self._threads: ThreadPoolExecutor | None = None
        self._processes: _ProcessPool | None = None
        if self._async:
            return  # it runs on the event loop, whatever the executor
        if executor == "thread":
            self._threads = ThreadPoolExecutor(max_workers, thread_name_prefix="reward")
            return
        try:
            payload = pickle.dumps(fn)
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            raise RewardError(
                f"reward {fn!r} cannot run in a process pool, it does not pickle ({exc}): "
                "define it at the top level of a module (or a `file.py`) and refer to it as "
                "`module:function` (`file.py:function`), or use the thread executor"
            ) from None
        self._processes = _ProcessPool(payload)

    async def __call__(self, prompt: str, completion: str, row: Row) -> RewardOutcome:
        outcome = await self._run(prompt, completion, row)
        self.counts[outcome.status] += 1
        return outcome

    def close(self) -> None:
        """Shut the pools down (a hung thread is left to finish; worker processes are killed)."""
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
        if self._processes is not None:
            self._processes.close()

    async def _run(self, prompt: str, completion: str, row: Row) -> RewardOutcome:
        try:
            if self._async:
                value = await asyncio.wait_for(self.fn(prompt, completion, row), self.timeout)
            elif self._threads is not None:
                async with self._slots:
                    loop = asyncio.get_running_loop()
                    future = loop.run_in_executor(self._threads, self.fn, prompt, completion, row)
                    value = await asyncio.wait_for(future, self.timeout)
            else:
                assert self._processes is not None
                async with self._slots:
                    value = await self._processes.call((prompt, completion, row), self.timeout)
        except TimeoutError:
            return RewardOutcome(None, "timeout", f"no value after {self.timeout:g} s")
        except _WorkerRaised as exc:
            return RewardOutcome(None, "error", str(exc))
        # the fault-tolerance policy: whatever the user's function raises is an outcome
        except Exception as exc:
            return RewardOutcome(None, "error", f"{type(exc).__name__}: {exc}")
        return _outcome(value)


def _outcome(value: Any) -> RewardOutcome:
    if isinstance(value, bool):
        return RewardOutcome(float(value), "ok")
    if isinstance(value, numbers.Real):
        try:
            number = float(value)
        except OverflowError:
            number = math.inf
        if math.isfinite(number):
            return RewardOutcome(number, "ok")
        return RewardOutcome(None, "invalid", f"returned {_shown(value)}: a reward must be finite")
    return RewardOutcome(
        None,
        "invalid",
        f"returned {_shown(value)} ({type(value).__name__}): a reward is a number or a bool",
    )


def _shown(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= 80 else shown[:77] + "..."


_START_TIMEOUT = 120.0
"""Seconds a new worker process may take to load the function (importing its module)."""


class _ProcessPool:
    """Worker processes, one call at a time each, started on demand up to the runner's
    `max_workers` (its semaphore bounds the calls in flight, so an idle one or room for a new
    one is always there)."""

    def __init__(self, payload: bytes) -> None:
        self._payload = payload
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()
        self._broken: str | None = None

    async def call(self, args: tuple[str, str, Row], seconds: float) -> Any:
        if self._broken is not None:
            raise RuntimeError(self._broken)
        worker = self._idle.pop() if self._idle else await self._start()
        done = False
        try:
            status, value = await asyncio.wait_for(worker.call(args), seconds)
            done = True
        finally:
            if done:
                self._idle.append(worker)
            else:  # timed out or cancelled mid-call: its answer would come to the next caller
                self._discard(worker)
        if status == "error":
            raise _WorkerRaised(value)
        return value

    async def _start(self) -> _Worker:
        # off the loop: the first start also starts the forkserver
        worker = await asyncio.to_thread(_Worker, self._payload)
        self._all.add(worker)
        status, detail = "", ""
        try:
            status, detail = await asyncio.wait_for(worker.ready(), _START_TIMEOUT)
        except TimeoutError:
            raise RuntimeError(f"a reward worker did not start in {_START_TIMEOUT:g} s") from None
        finally:
            if status != "ready":
                self._discard(worker)
        if status != "ready":  # it could not unpickle the function: no worker ever will
            self._broken = f"the reward function cannot be loaded in a worker process: {detail}"
            raise RuntimeError(self._broken)
        return worker

    def _discard(self, worker: _Worker) -> None:
        worker.kill()
        self._all.discard(worker)

    def close(self) -> None:
        for worker in list(self._all):
            self._discard(worker)
        self._idle.clear()


class _WorkerRaised(Exception):
    """The function raised in a worker process; the message is `Type: message` from there."""

    def __str__(self) -> str:
        return str(self.args[0])


class _Worker:
    """One worker process and the pipe to it: it loads the function, says `ready`, then answers
    each `(prompt, completion, row)` with `("ok", value)` or `("error", "Type: message")`."""

    def __init__(self, payload: bytes) -> None:
        context = multiprocessing.get_context("forkserver")
        self._conn, child = context.Pipe()
        self._process = context.Process(
            target=_serve, args=(child, payload), name="reward-worker", daemon=True
        )
        self._process.start()
        child.close()

    async def ready(self) -> tuple[str, str]:
        reply: tuple[str, str] = await self._receive()
        return reply

    async def call(self, args: tuple[str, str, Row]) -> tuple[str, Any]:
        self._conn.send(args)
        reply: tuple[str, Any] = await self._receive()
        return reply

    async def _receive(self) -> Any:
        loop = asyncio.get_running_loop()
        readable: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            if not readable.done():
                readable.set_result(None)

        fd = self._conn.fileno()
        loop.add_reader(fd, wake)
        try:
            await readable
        finally:
            loop.remove_reader(fd)
        try:
            return self._conn.recv()
        except EOFError:
            self._process.join(1)
            raise RuntimeError(
                f"the reward worker process died (exit code {self._process.exitcode})"
            ) from None

    def kill(self) -> None:
        self._process.kill()
        self._process.join(5)
        self._conn.close()


def _serve(conn: Connection, payload: bytes) -> None:
    """A worker process's loop (`_Worker`)."""
    try:
        fn = pickle.loads(payload)
    except Exception as exc:
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", ""))
    while True:
        try:
            args = conn.recv()
        except EOFError:
            return
        try:
            reply: tuple[str, Any] = ("ok", fn(*args))
            conn.send(reply)
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


def _is_async(fn: RewardFn) -> bool:
    """An `async def` function, or an object whose `__call__` is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def _load_file(path: Path, ref: str) -> Any:
    try:
        return load_file(path)
    except ValueError as exc:
        raise RewardError(f"reward {ref!r}: {exc}") from None


def _attribute(module: Any, name: str, ref: str, where: str) -> RewardFn:
    obj = module
    for part in name.split("."):
        obj = getattr(obj, part, _MISSING)
        if obj is _MISSING:
            raise RewardError(f"reward {ref!r}: {where} has no attribute {name!r}")
    return _checked(obj, ref)


_MISSING = object()


def _checked(obj: Any, ref: str) -> RewardFn:
    if not callable(obj):
        raise RewardError(f"reward {ref!r} is a {type(obj).__name__}, not a function")
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):  # some builtins have none to read
        return cast(RewardFn, obj)
    try:
        signature.bind("prompt", "completion", {})
    except TypeError:
        raise RewardError(
            f"reward {ref!r} takes {signature}, but a reward function is called as "
            "fn(prompt, completion, row)"
        ) from None
    return cast(RewardFn, obj)
