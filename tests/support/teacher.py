"""The trainer's teacher-forced logprobs of a token sequence: what engine parity tests compare a
recording with."""

from __future__ import annotations

from typing import Any


def teacher_forced(backend: Any, tokens: list[int], temperature: float) -> list[float]:
    """The backend's logprob of every token given the ones before it (entry 0 is 0), at
    `temperature`, as the trainer computes it for the loss."""
    from trainer.batch import TrainSequence

    n = len(tokens)
    seq = TrainSequence(
        tokens=tokens,
        loss_mask=[0] * n,
        behav_logprobs=[0.0] * n,
        advantages=[0.0] * n,
        versions=[-1] * n,
    )
    out: list[float] = backend.forward_logprobs([seq], temperature)[0]
    return out
