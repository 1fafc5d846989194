"""The policy's weights on their way to the engines: Hugging Face names, in bounded buckets.

A publisher (`trainer.publish`) gets `Weights`: the tensors' names, dtypes and full shapes up front
(`metas`), and the tensors themselves a bucket at a time (`buckets`), each bucket at most
`bucket_bytes` (a larger tensor alone), in `buckets_of`'s cut of `metas`; it may go over them more
than once (a version that fails over the weight group goes again from disk).

- `StateDictWeights`: a whole state dict in this process.
- `ShardedWeights`: a training backend's weights, sharded over its ranks. Each bucket is gathered
  when it is asked for, every rank taking part (`TrainBackend.weight_buckets`: FSDP, tensor and
  expert shards all-gathered tensor by tensor), so no rank holds more than one bucket of full
  tensors beside its own shards; the whole model is never gathered on one rank. Rank 0, where the
  publisher runs, tells the other ranks (`serve_weight_passes`) when a pass begins and, at the
  end (`close`), that there are no more.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from engines.base import TensorMeta

if TYPE_CHECKING:
    from trainer.backends.base import TrainBackend


def tensor_meta(name: str, tensor: torch.Tensor) -> TensorMeta:
    """`tensor`'s name, dtype name and (full, for a sharded tensor) shape."""
    return TensorMeta(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))


def nbytes(meta: TensorMeta) -> int:
    dtype: torch.dtype = getattr(torch, meta.dtype)
    return dtype.itemsize * math.prod(meta.shape)


def buckets_of(
    metas: Sequence[TensorMeta], bucket_bytes: int
) -> tuple[tuple[TensorMeta, ...], ...]:
    """`metas` in order, cut into runs of at most `bucket_bytes` (a larger tensor alone)."""
    buckets: list[tuple[TensorMeta, ...]] = []
    current: list[TensorMeta] = []
    size = 0
    for meta in metas:
        n = nbytes(meta)
        if current and size + n > bucket_bytes:
            buckets.append(tuple(current))
            current, size = [], 0
        current.append(meta)
        size += n
    if current:
        buckets.append(tuple(current))
    return tuple(buckets)


class Weights(Protocol):
    """A policy's weights as a publisher reads them (module docstring)."""

    def metas(self) -> tuple[TensorMeta, ...]:
        """Every tensor's name, dtype and full shape, in the order `buckets` yields them."""
        ...

    def buckets(self, bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
        """The tensors on CPU, `buckets_of(metas(), bucket_bytes)`'s cut, in order."""
        ...


def gather_all(weights: Weights) -> dict[str, torch.Tensor]:
    """Every tensor of `weights` in one dict (for a consumer that needs them all at once)."""
    out: dict[str, torch.Tensor] = {}
    for bucket in weights.buckets(1 << 62):
        out |= bucket
    return out


class StateDictWeights:
    """`Weights` over a state dict in this process (its tensors are handed out as they are)."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        self.state_dict = state_dict

    def metas(self) -> tuple[TensorMeta, ...]:
        return tuple(tensor_meta(name, t) for name, t in self.state_dict.items())

    def buckets(self, bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
        for bucket in buckets_of(self.metas(), bucket_bytes):
            yield {meta.name: self.state_dict[meta.name] for meta in bucket}


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _from_rank0(message: Any) -> Any:
    """Rank 0's `message` on every rank."""
    import torch.distributed as dist

    box = [message]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class ShardedWeights:
    """`Weights` of a (possibly sharded) training backend, on rank 0 (module docstring). Use it
    as a context manager, or `close` it: the other ranks serve passes until then."""

    def __init__(self, backend: TrainBackend) -> None:
        self.backend = backend
        self._metas = tuple(backend.weight_metas())
        self._closed = False

    def metas(self) -> tuple[TensorMeta, ...]:
        return self._metas

    def buckets(self, bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
        if self._closed:
            raise RuntimeError("these weights were closed: the other ranks have left")
        if _world_size() > 1:
            _from_rank0(bucket_bytes)  # the other ranks start the same pass
        passing = self.backend.weight_buckets(bucket_bytes)
        try:
            yield from passing
        finally:
            for _ in passing:  # a consumer that stops early: the other ranks gather every bucket
                pass

    def close(self) -> None:
        """Tells the other ranks that no pass follows (idempotent)."""
        if not self._closed and _world_size() > 1:
            _from_rank0(None)
        self._closed = True

    def __enter__(self) -> ShardedWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_weight_passes(backend: TrainBackend) -> int:
    """On a rank other than 0: take part in every pass over `backend`'s weights that rank 0's
    `ShardedWeights` makes, until it closes them; returns the number of passes."""
    passes = 0
    while (bucket_bytes := _from_rank0(None)) is not None:
        for _ in backend.weight_buckets(bucket_bytes):
            pass
        passes += 1
    return passes
