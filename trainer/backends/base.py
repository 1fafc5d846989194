"""The training-backend seam: what the training loop asks of a backend (FSDP2, Megatron, Archon).

A backend owns the policy's weights, optimizer and LR schedule, possibly sharded over many
processes. Every rank calls every method with the same arguments (the full batch); the backend
splits the work among ranks itself. Losses are callbacks so that algorithms stay pure functions
(`trainer/algorithms/`) and know nothing of packing, ranks or devices.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Literal, Protocol

import torch

from engines.base import TensorMeta
from trainer.batch import MicroBatch, TrainSequence

LossFn = Callable[
    [torch.Tensor, MicroBatch, float, torch.Tensor | None], tuple[torch.Tensor, Mapping[str, float]]
]
"""`loss_fn(logp_1T, mb, normalizer, entropy_1T) -> (loss, stats)`.

`logp_1T` is the current policy's float32 logprob of each shifted target of `mb` (with grad), at
the target's temperature (`mb.temperature_1T`, else the step's one temperature). `entropy_1T` is
the entropy of the distribution each target was drawn from (`trainer.batch.token_entropy`): with
grad under `entropy="loss"`, without under `entropy="metric"`, None under `entropy="off"`.
`normalizer` is the caller's `global_norm` for the whole batch (e.g. its number of trained tokens
over all ranks), and the loss is the micro-batch's sum divided by it, so that the micro-batch losses
of all ranks add up to the full-batch loss and gradient accumulation and data parallelism give the
gradient of one big batch. Stats are means over the micro-batch's trained tokens; the backend
averages them over micro-batches and ranks weighted by trained-token counts.
"""


EntropyMode = Literal["off", "metric", "loss"]
"""What `train_step` computes of the policy's entropy: nothing, a detached metric, or a term the
loss differentiates (an entropy bonus)."""


class TrainBackend(Protocol):
    """A trainable policy. `step` counts optimizer steps taken (restored by `load`); a training
    step of the loop takes one per mini-batch."""

    step: int
    model_dir: Path
    """The Hugging Face directory the policy was loaded from: its config and tokenizer describe
    the trained weights too (checkpoints record it, so an export can find them)."""

    def forward_logprobs(
        self, seqs: Sequence[TrainSequence], temperature: float, *, token_budget: int = 8192
    ) -> list[list[float]]:
        """Logprob of every token under the current weights, without grad (the proximal or
        reference pass): entry t of sequence i is `log_softmax(logits[t-1] / temperature)[tok_t]`,
        and entry 0 is 0. Every rank gets the full result."""
        ...

    def train_step(
        self,
        seqs: Sequence[TrainSequence],
        loss_fn: LossFn,
        *,
        temperature: float,
        token_budget: int,
        global_norm: float,
        entropy: EntropyMode = "off",
        step_schedule: bool = True,
    ) -> dict[str, float]:
        """One optimizer step on `seqs`: pack into micro-batches of `token_budget` tokens, call
        `loss_fn(logp_1T, mb, global_norm, entropy_1T)` on each (the entropy as `entropy` says)
        and accumulate gradients, clip the grad norm (the backend's `grad_clip`), step the
        optimizer and (with `step_schedule`; the training loop advances it once per training
        step, after its last mini-batch) the LR schedule. `global_norm` is the
        loss normaliser of the whole batch (see `LossFn`); it must be positive.

        Returns the stats of `loss_fn` averaged over all ranks, plus `loss` (the summed loss of
        every micro-batch: the full-batch loss), `grad_norm` (before clipping) and `lr` (used by
        this step); these three names are the backend's and override stats of the same name.
        """
        ...

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full, unsharded weights with Hugging Face names on CPU on rank 0; {} on other ranks."""
        ...

    def weight_metas(self) -> list[TensorMeta]:
        """The name (Hugging Face), dtype and full shape of every weight, in the order of
        `weight_buckets`; no communication."""
        ...

    def weight_buckets(self, bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
        """The full weights a bucket at a time (`trainer.weights.buckets_of(weight_metas(),
        bucket_bytes)`), on CPU on rank 0, {} per bucket elsewhere; every rank iterates it to the
        end together (each tensor is gathered from its shards as its bucket comes), so no rank
        holds more than a bucket of full tensors at once. Equal to `full_state_dict`."""
        ...

    def save(self, path: str | Path) -> None:
        """Writes model, optimizer, LR schedule and step into directory `path` (all ranks call)."""
        ...

    def load(self, path: str | Path) -> None:
        """Restores what `save` wrote, so that training continues exactly as without a restart."""
        ...


class ValueBackend(Protocol):
    """A trainable value model (the PPO critic), sharded and checkpointed like a policy.

    `train_step` is `TrainBackend.train_step` with one difference: the loss callback's first
    argument is the float32 value at each row position (with grad), aligned like logprobs: the
    value at position i is that of the state before the token at i + 1 (`temperature` is unused).
    """

    step: int

    def forward_values(
        self, seqs: Sequence[TrainSequence], *, token_budget: int = 8192
    ) -> list[list[float]]:
        """Value of the state before every token, without grad: entry t of sequence i is computed
        at position t - 1, and entry 0 is 0. Every rank gets the full result."""
        ...

    def train_step(
        self,
        seqs: Sequence[TrainSequence],
        loss_fn: LossFn,
        *,
        temperature: float,
        token_budget: int,
        global_norm: float,
        step_schedule: bool = True,
    ) -> dict[str, float]:
        """One optimizer step of the value model (see `TrainBackend.train_step`)."""
        ...

    def save(self, path: str | Path) -> None:
        """Writes weights, optimizer, LR schedule and step into directory `path`."""
        ...

    def load(self, path: str | Path) -> None:
        """Restores what `save` wrote."""
        ...
