"""Supervised fine-tuning through the same backend the RL loop uses (a warm start, or SFT on
exported trajectories): next-token cross-entropy on the completion tokens only.

An `SFTExample` is a prompt and a completion as token ids; `sft_sequences` turns examples into
`TrainSequence`s whose loss mask covers the completion, and `sft_loss_fn` is a `LossFn` whose
micro-batch losses add up to the mean negative log-likelihood per completion token of the whole
batch (pass the batch's completion-token count as `global_norm`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from trainer.backends.base import TrainBackend
from trainer.batch import MicroBatch, TrainSequence


@dataclass(frozen=True, slots=True)
class SFTExample:
    """Token ids of a prompt (never trained) and its completion (trained). Both non-empty."""

    prompt: list[int]
    completion: list[int]

    def __post_init__(self) -> None:
        if not self.prompt or not self.completion:
            raise ValueError("an SFT example needs a non-empty prompt and completion")


def sft_sequences(examples: Sequence[SFTExample]) -> list[TrainSequence]:
    out = []
    for ex in examples:
        tokens = ex.prompt + ex.completion
        mask = [0] * len(ex.prompt) + [1] * len(ex.completion)
        zeros = [0.0] * len(tokens)
        out.append(
            TrainSequence(
                tokens=tokens,
                loss_mask=mask,
                behav_logprobs=zeros,
                advantages=zeros,
                versions=[-1] * len(tokens),
            )
        )
    return out


def sft_loss_fn(
    logp_1T: torch.Tensor, mb: MicroBatch, normalizer: float, entropy_1T: torch.Tensor | None
) -> tuple[torch.Tensor, Mapping[str, float]]:
    """Summed NLL of the micro-batch's completion tokens over `normalizer`."""
    mask = mb.loss_mask_1T
    nll = -(logp_1T * mask).sum()
    n = mask.sum().clamp(min=1)
    return nll / normalizer, {"nll": float(nll.detach() / n)}


def sft_step(
    backend: TrainBackend, examples: Sequence[SFTExample], *, token_budget: int = 1024
) -> dict[str, float]:
    """One optimizer step of SFT on `examples` (temperature 1: plain cross-entropy)."""
    seqs = sft_sequences(examples)
    n = sum(s.num_loss_tokens for s in seqs)
    return backend.train_step(
        seqs, sft_loss_fn, temperature=1.0, token_budget=token_budget, global_norm=float(n)
    )
