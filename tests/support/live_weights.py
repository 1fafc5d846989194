"""Weights whose buckets count how many of them are alive at once: a publisher must read a
trainer's weights as it sends or writes them, not all first (each bucket is gathered from the
trainer's shards as it is read, so reading them all first gathers the whole model)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from trainer.weights import StateDictWeights


class LiveBucket(dict[str, torch.Tensor]):
    """A bucket that counts how many of its kind are alive at once."""

    live = 0
    most = 0

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        LiveBucket.live += 1
        LiveBucket.most = max(LiveBucket.most, LiveBucket.live)

    def __del__(self) -> None:
        LiveBucket.live -= 1


class CountedWeights(StateDictWeights):
    """A state dict whose buckets count themselves: the publisher must read them as it sends
    them, not all first (a trainer's are gathered from its shards as they are read)."""

    def buckets(self, bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
        for bucket in super().buckets(bucket_bytes):
            yield LiveBucket(bucket)
