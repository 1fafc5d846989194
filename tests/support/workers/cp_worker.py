"""A fixed context-parallel run, shared by the test process (one rank, `fsdp`) and the processes
that torchrun starts (`fsdp:c2`, `fsdp:d2c2`, `fsdp:c2t2`), so that the two can be compared.

From the repository root, `PYTHONPATH=. python -m torch.distributed.run --nproc-per-node 2
tests/support/workers/cp_worker.py MODEL OUT ALLOC` runs `run(MODEL, ALLOC)` on every rank and
writes each rank's result to OUT/rank{r}.pt (`torch.save`; the full state dict is rank 0's only, {}
elsewhere).

The sequences pack (`TOKEN_BUDGET` 48, one data rank) into rows [61], [30, 16], [25, 19, 3] and
[13, 9, 7, 5]: rows of odd length (padded for 2 context ranks) of one sequence and of several,
and sequences that cross the middle of their row (the 25 of [25, 19, 3], the 9 of
[13, 9, 7, 5]). Every sequence has per-token temperatures (its second half sampled hotter), so the
temperatures are sliced with the tokens too. Under `fsdp:d2c2` the two data ranks pack 3 and 2
micro-batches, so one context group runs an empty pass.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from tests.support.workers import fsdp_worker, tp_worker
from trainer.batch import TrainSequence

LENGTHS = (13, 30, 7, 19, 25, 5, 61, 9, 16, 3)
"""Packed at `fsdp_worker.TOKEN_BUDGET` (48) into the rows above. The caller's temperature
(`fsdp_worker.TEMPERATURE`, 0.7) is overridden by every sequence's own per-token ones."""


def make_sequences(seed: int = 0) -> list[TrainSequence]:
    """`fsdp_worker.make_sequences` of `LENGTHS`, sampled at 0.7 then, from their middle on, at
    1.1."""
    return fsdp_worker.make_sequences(
        seed, LENGTHS, lambda n: [0.7 if t < n // 2 else 1.1 for t in range(n)]
    )


def run(model_dir: str | Path, allocation: str) -> dict[str, Any]:
    """The tensor-parallel worker's run (`tp_worker.run`: `STEPS` policy steps with an entropy
    bonus, logprobs, weights, a critic step) on these sequences, without a checkpoint."""
    return tp_worker.run(model_dir, allocation, None, make_sequences())


def main(model_dir: str, out: str, allocation: str) -> None:
    import torch.distributed as dist

    result = run(model_dir, allocation)
    torch.save(result, Path(out) / f"rank{dist.get_rank()}.pt")


if __name__ == "__main__":
    from tests.support.torchrun import exit_worker

    main(*sys.argv[1:])
    exit_worker()
