"""The engine process: a `LocalEngine` driven over a socket by `engines.process.ProcessEngine`.

    python -m engines.process_main FD

FD is this process's end of a socketpair. The main thread reads commands (`engines.ipc`) and
calls the engine's synchronous controls; the engine's worker thread writes each step's output as
one `Step` message. The process exits when told to close or when the gateway's end goes away
(EOF), so it never outlives the gateway. SIGINT and SIGTERM are ignored: a Ctrl-C at the
terminal, or a service manager's SIGTERM to the process group, reaches this process too, and the
gateway, not this process, decides when the engine stops (after its requests in flight have
finished, so a clean shutdown is not mistaken for an engine crash). If the engine's worker
fails (`engines.local.MAX_FAILED_STEPS` failed steps in a row, or a weight swap that failed
half-way), the process exits with `EXIT_ENGINE_FAILED` once the failure was sent, so that the
gateway's side (`engines.process.ProcessEngine`) starts a fresh one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING

from engines.base import WeightUpdate
from engines.errors import (
    EngineError,
    EngineUnavailableError,
    InvalidRequestError,
    RequestFailedError,
    WeightUpdateError,
)
from engines.ipc import (
    Abort,
    ChunkRow,
    Control,
    ErrorKind,
    FromEngine,
    LoadWeights,
    Ready,
    Reply,
    Start,
    StartFailed,
    Step,
    Submit,
    ToEngine,
    open_shared,
)

if TYPE_CHECKING:
    import concurrent.futures

    from engines.local_worker import LocalWorker, _Item

log = logging.getLogger("engines.process_main")

EXIT_ENGINE_FAILED = 70
"""The exit code of an engine process whose engine failed (EX_SOFTWARE)."""


class _Sender:
    """Whole messages onto the socket, from the main thread and the worker thread alike."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, msg: FromEngine) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        # OSError: the gateway is gone; the main thread sees EOF and exits
        with self._lock, contextlib.suppress(OSError):
            self.conn.send_bytes(data)


class _PipeConsumer:
    """Every request of this process goes to the gateway: one `Step` message per engine step."""

    def __init__(self, engine: LocalWorker, sender: _Sender) -> None:
        self.engine = engine
        self.sender = sender

    def deliver(self, items: list[tuple[str, _Item]]) -> None:
        chunks: list[ChunkRow] = []
        errors: list[tuple[str, ErrorKind, str, float | None]] = []
        for request_id, item in items:
            if isinstance(item, BaseException):
                retry = item.retry_after if isinstance(item, EngineUnavailableError) else None
                errors.append((request_id, _kind(item), str(item), retry))
            else:
                finish = item.finish_reason.value if item.finish_reason is not None else None
                chunks.append(
                    (
                        request_id,
                        item.token_ids,
                        item.logprobs,
                        item.versions,
                        finish,
                        item.top_logprobs,
                    )
                )
        self.sender.send(Step(self.engine.version(), self.engine.stats, chunks, errors))


def _kind(exc: BaseException) -> ErrorKind:
    if isinstance(exc, WeightUpdateError):
        return "weight_update"
    if isinstance(exc, InvalidRequestError):
        return "invalid"
    if isinstance(exc, RequestFailedError):
        return "failed"
    return "unavailable"


class _Server:
    def __init__(self, engine: LocalWorker, sender: _Sender) -> None:
        self.engine = engine
        self.sender = sender
        self.consumer = _PipeConsumer(engine, sender)

    def handle(self, msg: ToEngine) -> bool:
        """Serve one command; False once the engine is closed."""
        engine = self.engine
        if isinstance(msg, Submit):
            try:
                engine.submit(msg.request, self.consumer)
            except EngineError as exc:
                self.consumer.deliver([(msg.request.request_id, exc)])
        elif isinstance(msg, Abort):
            engine.abort_now(msg.request_id)
        elif isinstance(msg, LoadWeights):
            self._load(msg)
        elif isinstance(msg, Control):
            if msg.op == "close":
                engine.close_now()
                self.sender.send(Reply(msg.call_id))
                return False
            if msg.op == "pause":
                engine.set_paused(True)
                engine.wait_step()
                self.sender.send(Reply(msg.call_id))
            elif msg.op == "resume":
                engine.set_paused(False)
                self.sender.send(Reply(msg.call_id))
            else:
                self.sender.send(Reply(msg.call_id, engine.health_now()))
        else:
            raise TypeError(f"unexpected message {type(msg).__name__}")
        return True

    def _load(self, msg: LoadWeights) -> None:
        try:
            if msg.shared is not None:
                # Mapped first, so that the gateway may unlink the file once this is answered.
                try:
                    state = open_shared(msg.shared)
                except (OSError, ValueError) as exc:  # gone or short: refuse, change nothing
                    raise WeightUpdateError(f"could not map the staged weights: {exc}") from exc
                update = WeightUpdate(state_dict=state, version=msg.version)
            else:
                assert msg.path is not None
                update = WeightUpdate(path=Path(msg.path), version=msg.version)
            future = self.engine.submit_update(update)
        except Exception as exc:
            self.sender.send(Reply(msg.call_id, error=(_kind(exc), str(exc))))
            return

        def answer(done: concurrent.futures.Future[int]) -> None:
            exc = done.exception()
            if exc is None:
                self.sender.send(Reply(msg.call_id, done.result()))
            else:
                self.sender.send(Reply(msg.call_id, error=(_kind(exc), str(exc))))

        future.add_done_callback(answer)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s engine-process: %(message)s"
    )
    conn = Connection(int(argv[0]))
    sender = _Sender(conn)
    start = pickle.loads(conn.recv_bytes())
    assert isinstance(start, Start), f"expected Start, got {type(start).__name__}"

    import torch

    from engines.local import LocalEngine

    torch.set_num_threads(start.threads)
    try:
        engine = LocalEngine.load(start.config).worker  # the pipe drives the worker itself
    except Exception as exc:
        sender.send(StartFailed("value" if isinstance(exc, ValueError) else "other", repr(exc)))
        return 1
    sender.send(
        Ready(
            eos_token_ids=engine.eos_token_ids,
            max_model_len=engine.max_model_len,
            vocab_size=engine.runner.vocab_size,
            version=engine.version(),
            threads=torch.get_num_threads(),
        )
    )
    server = _Server(engine, sender)
    threading.Thread(
        target=_exit_if_failed, args=(engine,), name="rlgateway-engine-watch", daemon=True
    ).start()
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):  # the gateway went away: stop with it
            engine.close_now()
            return 0
        if not server.handle(pickle.loads(data)):
            return 0


def _exit_if_failed(engine: LocalWorker) -> None:
    """Exit the process once the engine's worker has failed. The worker sent every request's
    failure before it stopped; an engine that failed cannot serve again, a fresh process can."""
    failure = engine.wait_stopped()
    if failure is not None:
        log.error("the engine failed (%r); exiting so that a fresh engine process starts", failure)
        logging.shutdown()
        os._exit(EXIT_ENGINE_FAILED)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
