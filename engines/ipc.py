"""The messages between `ProcessEngine` (the gateway's side) and its engine process.

One duplex socket carries length-prefixed pickles (4-byte big-endian length, the framing of
`multiprocessing.connection.Connection`, which the engine process uses) of the typed structs
below; only the two ends of one `ProcessEngine` speak it, so both are trusted and run the same
code. Token output travels as one `Step` per decode step (every sequence's new tokens
together), not one message per token. Weights from a state dict do not travel through the socket:
they are copied once into a shared-memory file (`WeightStage`) that the engine process maps, and
only their layout (`SharedWeights`) is sent.
"""

from __future__ import annotations

import os
import pickle
import socket
import struct
import tempfile
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from engines.base import EngineHealth, GenerateRequest

if TYPE_CHECKING:
    import torch

    from engines.local import EngineStats, LocalEngineConfig

ErrorKind = Literal["invalid", "unavailable", "weight_update"]
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
    errors: list[tuple[str, str]]
    """(request id, message): the request failed with `EngineUnavailableError(message)`."""


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


class WeightStage:
    """The gateway's side of shared-memory weights: one file, reused while the state dict fits,
    into which each update is copied (one copy, from any device). The file's name is unlinked once
    the engine process has mapped it, so nothing is left behind if either side dies."""

    def __init__(self) -> None:
        self._path: str | None = None
        self._buffer: torch.Tensor | None = None
        self._linked = False

    def stage(self, state_dict: Mapping[str, torch.Tensor]) -> SharedWeights:
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
        if self._buffer is None or self._buffer.numel() < size:
            self.close()
            self._path = str(_shm_dir() / f"rlgateway-weights-{os.getpid()}-{uuid.uuid4().hex}")
            self._buffer = torch.from_file(
                self._path, shared=True, size=max(size, 1), dtype=torch.uint8
            )
            self._linked = True
        assert self._path is not None
        with torch.no_grad():
            for slot in slots:
                view(self._buffer, slot).copy_(state_dict[slot.name])
        return SharedWeights(self._path, int(self._buffer.numel()), tuple(slots))

    def mapped(self) -> None:
        """The engine process has mapped the file: its name is no longer needed."""
        if self._linked and self._path is not None:
            Path(self._path).unlink(missing_ok=True)
            self._linked = False

    def close(self) -> None:
        """Forget the file (a new one is made on the next `stage`)."""
        self.mapped()
        self._path = None
        self._buffer = None


def view(buffer: torch.Tensor, slot: TensorSlot) -> torch.Tensor:
    """The tensor `slot` describes, as a view into the uint8 `buffer` (no copy)."""
    import torch

    dtype = getattr(torch, slot.dtype)
    flat = buffer[slot.offset : slot.offset + slot.nbytes]
    return flat.view(dtype).view(slot.shape)


def open_shared(weights: SharedWeights, maps: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The engine process's side: map `weights.path` (once; `maps` caches the mapping by path
    and keeps only the newest file) and return the state dict as views into it."""
    import torch

    buffer = maps.get(weights.path)
    if buffer is None:
        maps.clear()
        buffer = torch.from_file(weights.path, shared=True, size=weights.size, dtype=torch.uint8)
        maps[weights.path] = buffer
    return {slot.name: view(buffer, slot) for slot in weights.tensors}
