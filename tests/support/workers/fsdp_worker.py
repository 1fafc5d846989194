"""A fixed FSDP training run, shared by the test process and the processes that torchrun starts.

`python -m torch.distributed.run --nproc-per-node 2 tests/support/workers/fsdp_worker.py MODEL OUT`
trains `STEPS` steps on `make_sequences()`, then has rank 0 write the full state dict, the
per-step stats and the sequences' logprobs under the trained weights to OUT (`torch.save`).
`train(backend, seqs)` is the same run for a backend built in the calling process, so one process
and two can be compared.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from trainer.backends.fsdp import FSDPBackend
from trainer.backends.registry import BACKEND_CLASSES, VALUE_BACKEND_CLASSES
from trainer.batch import MicroBatch, TrainSequence
from trainer.parallel.strategy import parse_allocation

STEPS = 3
TEMPERATURE = 0.7
TOKEN_BUDGET = 48
LENGTHS = (12, 30, 7, 19, 25, 4, 60, 9, 16)
"""One sequence is longer than the budget; the two ranks' shares pack into different numbers of
micro-batches (rank 0: 3, rank 1: 2), so rank 1 runs an empty pass."""


def build_backend(
    model_dir: str | Path, allocation: str = "fsdp", *, value: bool = False, **extra: Any
) -> Any:
    """The backend that `allocation` names (a warmup and cosine schedule, so resume must restore
    the LR), or with `value` its critic; `extra` are the backend's own settings. An FSDP backend
    (or subclass), or a `MegatronBackend`."""
    classes = VALUE_BACKEND_CLASSES if value else BACKEND_CLASSES
    backend = classes[parse_allocation(allocation).backend](
        model_dir,
        lr=1e-4,
        weight_decay=0.01,
        grad_clip=1.0,
        warmup_steps=1,
        total_steps=4,
        schedule="cosine",
        allocation=parse_allocation(allocation),
        **extra,
    )
    return backend


def make_sequences(
    seed: int = 0,
    lengths: Sequence[int] = LENGTHS,
    temperatures: Callable[[int], list[float]] | None = None,
) -> list[TrainSequence]:
    """Prompt-then-response sequences of `lengths` with +-1 advantages on the response tokens;
    with `temperatures`, each sequence's per-token temperatures (a function of its length)."""
    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for k, n in enumerate(lengths):
        tokens = torch.randint(0, 256, (n,), generator=gen).tolist()
        prompt = max(1, n // 3)
        mask = [0] * prompt + [1] * (n - prompt)
        sign = 1.0 if k % 2 else -1.0
        behav = (-3.0 - torch.rand(n, generator=gen)).tolist()
        seqs.append(
            TrainSequence(
                tokens=tokens,
                loss_mask=mask,
                behav_logprobs=[b * m for b, m in zip(behav, mask, strict=True)],
                advantages=[sign * m for m in mask],
                versions=[0 if m else -1 for m in mask],
                temperatures=None if temperatures is None else temperatures(n),
            )
        )
    return seqs


def policy_gradient_loss(
    logp_1T: torch.Tensor, mb: MicroBatch, normalizer: float, entropy_1T: torch.Tensor | None
) -> tuple[torch.Tensor, Mapping[str, float]]:
    """-sum(logp * advantage) over trained tokens / normalizer: the simplest policy gradient."""
    mask = mb.loss_mask_1T
    loss = -(logp_1T * mb.advantages_1T * mask).sum() / normalizer
    n = max(1, mb.num_loss_tokens)
    return loss, {"logp": float((logp_1T.detach() * mask).sum()) / n}


def train(backend: FSDPBackend, seqs: list[TrainSequence]) -> list[dict[str, float]]:
    """`STEPS` train steps on `seqs`, normalised by their trained-token count."""
    norm = float(sum(s.num_loss_tokens for s in seqs))
    return [
        backend.train_step(
            seqs,
            policy_gradient_loss,
            temperature=TEMPERATURE,
            token_budget=TOKEN_BUDGET,
            global_norm=norm,
        )
        for _ in range(STEPS)
    ]


def main(model_dir: str, out: str) -> None:
    backend = build_backend(model_dir)
    seqs = make_sequences()
    stats = train(backend, seqs)
    logprobs = backend.forward_logprobs(seqs, TEMPERATURE, token_budget=TOKEN_BUDGET)
    state = backend.full_state_dict()
    if backend.rank == 0:
        result = {"state": state, "stats": stats, "logprobs": logprobs}
        torch.save(result | {"world_size": backend.world_size}, Path(out))


if __name__ == "__main__":
    from tests.support.torchrun import exit_worker

    main(*sys.argv[1:])
    exit_worker()
