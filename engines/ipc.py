"""The messages between `ProcessEngine` (the gateway's side) and its engine process.

One duplex socket carries length-prefixed pickles (4-byte big-endian length, the framing of
`multiprocessing.connection.Connection`, which the engine process uses) of the typed structs
below; only the two ends of one `ProcessEngine` speak it, so both are trusted and run the same
code. Token output travels as one `Step` per decode step (every sequence's new tokens
together), not one message per token. Weights from a state dict do not travel through the socket:
they are copied once into a shared-memory file (`WeightStage`) that the engine process maps, and
only their layout (`SharedWeights`) is sent. The stage keeps the last applied state dict (one
copy, in shared memory), so that an engine process started after a crash can be given the
current weights again.
"""

from __future__ import annotations

import os
import pickle
import socket
import struct
import tempfile
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from engines.base import EngineHealth, GenerateRequest

if TYPE_CHECKING:
    import torch

    from engines.local import LocalEngineConfig
    from engines.local_worker import EngineStats

ErrorKind = Literal["invalid", "unavailable", "failed", "weight_update"]
"""Which `engines.errors` class a failure maps back to on the gateway's side."""

# -- gateway -> engine process ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Start:
    """The first message: what to load, and how many torch threads to compute with."""

    config: LocalEngineConfig
    threads: int


@dataclass(frozen=True, slots=True)
class Submit:
    """Start a request the gateway has already checked (`engines.base.check_request`)."""

    request: GenerateRequest


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class Control:
    """A call answered by one `Reply` with the same `call_id`: pause (answered once the step in
    progress has finished), resume, health (an `EngineHealth`), close (answered after every live
    request was aborted and the worker stopped; the process then exits)."""

    call_id: int
    op: Literal["pause", "resume", "health", "close"]


@dataclass(frozen=True, slots=True)
class TensorSlot:
    """One tensor inside a `SharedWeights` file: `nbytes` bytes at byte `offset`."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class SharedWeights:
    """A state dict laid out in the shared-memory file `path` of `size` bytes. The gateway keeps
    the file's contents unchanged until the `LoadWeights` that names it is answered."""

    path: str
    size: int
    tensors: tuple[TensorSlot, ...]


@dataclass(frozen=True, slots=True)
class LoadWeights:
    """Swap weights between steps; answered with the new version. Exactly one of `shared` and
    `path` (a HF model directory) is set."""

    call_id: int
    version: int | None
    shared: SharedWeights | None = None
    path: str | None = None


# -- engine process -> gateway ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ready:
    """The model is loaded and requests may be submitted."""

    eos_token_ids: frozenset[int]
    max_model_len: int
    vocab_size: int
    version: int
    threads: int


@dataclass(frozen=True, slots=True)
class StartFailed:
    kind: Literal["value", "other"]
    message: str


ChunkRow = tuple[
    str, tuple[int, ...], tuple[float, ...], tuple[int, ...], str | None, tuple[Any, ...]
]
"""(request id, token ids, logprobs, versions, finish reason or None, top logprobs): the fields
of one `TokenChunk`, flat."""


@dataclass(frozen=True, slots=True)
class Step:
    """Everything one decode step produced, for every request. A row with a finish reason, or an
    error, is its request's last. `version` and `stats` are the engine's after the step."""

    version: int
    stats: EngineStats
    chunks: list[ChunkRow]
    errors: list[tuple[str, ErrorKind, str, float | None]]
    """(request id, kind, message, retry_after): the request failed with the `engines.errors`
    class of `kind` (`RequestFailedError` for "failed")."""


@dataclass(frozen=True, slots=True)
class Reply:
    call_id: int
    value: int | EngineHealth | None = None
    error: tuple[ErrorKind, str] | None = None


ToEngine = Start | Submit | Abort | Control | LoadWeights
FromEngine = Ready | StartFailed | Step | Reply


# -- framing ------------------------------------------------------------------------------------

SOCKET_BUFFER = 4 * 1024 * 1024
"""Bytes of socket buffer each way."""

_HEADER = struct.Struct("!i")


def frame(msg: ToEngine | FromEngine) -> bytes:
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


class FrameReader:
    """Reads whatever has arrived on a socket in one call and returns every whole message."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buffer = bytearray()

    def read(self) -> list[Any]:
        """Blocks until at least one whole message arrived; `EOFError` when the peer closed."""
        messages: list[Any] = []
        while not messages:
            data = self.sock.recv(SOCKET_BUFFER)
            if not data:
                raise EOFError("the peer closed the socket")
            buf = self._buffer
            buf += data
            pos = 0
            while len(buf) - pos >= _HEADER.size:
                (n,) = _HEADER.unpack_from(buf, pos)
                end = pos + _HEADER.size + n
                if len(buf) < end:
                    break
                messages.append(pickle.loads(memoryview(buf)[pos + _HEADER.size : end]))
                pos = end
            del buf[:pos]
        return messages


# -- shared-memory weights ------------------------------------------------------------------------

_ALIGN = 64


def _shm_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else Path(tempfile.gettempdir())


@dataclass(frozen=True, slots=True)
class _Staged:
    weights: SharedWeights
    buffer: torch.Tensor


class WeightStage:
    """The gateway's side of shared-memory weights. Each update is copied (once, from any device)
    into a file of its own, whose name is unlinked once the engine process has answered (it maps
    the file first), so nothing is left behind if either side dies. The state dict last applied
    stays here (`commit`) until a newer one is, so that `restage` can hand it to a new engine
    process: one copy in memory, two only while an update or a restart is under way."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: _Staged | None = None
        self._applied: _Staged | None = None

    def stage(self, state_dict: Mapping[str, torch.Tensor]) -> SharedWeights:
        """Copy `state_dict` into a new file; `commit` or `discard` it once answered."""
        import torch

        slots: list[TensorSlot] = []
        size = 0
        for name, tensor in state_dict.items():
            nbytes = tensor.numel() * tensor.element_size()
            slots.append(
                TensorSlot(
                    name,
                    str(tensor.dtype).removeprefix("torch."),
                    tuple(tensor.shape),
                    size,
                    nbytes,
                )
            )
            size += -(-nbytes // _ALIGN) * _ALIGN
        staged = _new_file(size, tuple(slots))
        with torch.no_grad():
            for slot in slots:
                view(staged.buffer, slot).copy_(state_dict[slot.name])
        with self._lock:
            # one update at a time: a pending one left here was abandoned (its caller cancelled)
            stale, self._pending = self._pending, staged
        if stale is not None:
            _unlink(stale)
        return staged.weights

    def commit(self) -> None:
        """The engine process applied the staged update: it is now the one to keep."""
        with self._lock:
            pending, self._pending = self._pending, None
            if pending is not None:
                _unlink(pending)
                self._applied = pending

    def discard(self) -> None:
        """The staged update was refused or is lost: forget it (no-op once committed)."""
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            _unlink(pending)

    def drop_applied(self) -> None:
        """The weights now applied came from elsewhere (a directory): free the kept copy."""
        with self._lock:
            self._applied = None

    def restage(self) -> SharedWeights | None:
        """The last applied state dict in a new file, for a new engine process (None if none
        was applied); `unlink` it once that process has answered."""
        with self._lock:
            applied = self._applied
        if applied is None:
            return None
        staged = _new_file(applied.weights.size, applied.weights.tensors)
        staged.buffer.copy_(applied.buffer)
        return staged.weights

    def close(self) -> None:
        self.discard()
        self.drop_applied()


def unlink(weights: SharedWeights) -> None:
    Path(weights.path).unlink(missing_ok=True)


def _unlink(staged: _Staged) -> None:
    unlink(staged.weights)


def _new_file(size: int, slots: tuple[TensorSlot, ...]) -> _Staged:
    import torch

    path = str(_shm_dir() / f"rlgateway-weights-{os.getpid()}-{uuid.uuid4().hex}")
    buffer = torch.from_file(path, shared=True, size=max(size, 1), dtype=torch.uint8)
    return _Staged(SharedWeights(path, int(buffer.numel()), slots), buffer)


def view(buffer: torch.Tensor, slot: TensorSlot) -> torch.Tensor:
    """The tensor `slot` describes, as a view into the uint8 `buffer` (no copy)."""
    import torch

    dtype = getattr(torch, slot.dtype)
    flat = buffer[slot.offset : slot.offset + slot.nbytes]
    return flat.view(dtype).view(slot.shape)


def open_shared(weights: SharedWeights) -> dict[str, torch.Tensor]:
    """The engine process's side: map `weights.path` and return the state dict as views into it
    (the mapping lives as long as the views). `FileNotFoundError` or `ValueError` when the file
    is gone or short: never a fresh empty file, which `torch.from_file` would make of a missing
    path (and zeros are finite weights)."""
    import torch

    fd = os.open(weights.path, os.O_RDWR)  # pins the file, whether or not it is unlinked next
    try:
        if os.fstat(fd).st_size < weights.size:
            raise ValueError(f"the staged weights {weights.path} are shorter than announced")
        buffer = torch.from_file(
            f"/proc/self/fd/{fd}", shared=True, size=weights.size, dtype=torch.uint8
        )
    finally:
        os.close(fd)
    return {slot.name: view(buffer, slot) for slot in weights.tensors}
