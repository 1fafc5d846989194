"""The PPO critic on the FSDP2 machinery: the policy's backbone with a scalar value head.

`FSDPValueBackend` is `FSDPBackend` with two things swapped. The model is the policy's Hugging
Face architecture loaded as a token classifier with one label (`AutoModelForTokenClassification`,
as AReaL's critic), so the backbone starts from the policy's weights and only the value head
`score` (hidden -> 1, no bias) is new, seeded by the backend's `seed`; its dropout is 0, so values
are deterministic. And what the loss callback sees at each row position is that position's value
instead of a logprob. Sharding, packing, data parallelism, gradient accumulation, clipping, the LR
schedule, DCP checkpoints, tensor and context parallelism are the policy backend's own code;
under tensor parallelism the value head is replicated over the tensor ranks (its output is one
number per position, nothing to split), and under context parallelism each context rank computes
its slice's values, gathered into the row's like logprobs.

Alignment: the value at row position i is the critic's estimate of the state before the token at
i + 1 is sampled, the same "by predicting position" layout as logprobs, so `forward_values` gives
entry t = V(state before token t) (0 at t = 0), which is what `trainer.algorithms.gae` expects.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from trainer.backends.fsdp import FSDPBackend
from trainer.batch import TrainSequence
from trainer.parallel.tensor import Replicated
from trainer.parallel.vocab import VocabShard


def load_value_model(model_dir: str, attn_implementation: str = "sdpa") -> Any:
    """The value model of `model_dir` as plain HF: a one-label token classifier, no dropout."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    config = AutoConfig.from_pretrained(model_dir, num_labels=1)
    config.classifier_dropout = 0.0  # values must not be noisy in training mode
    # No bias (as OpenRLHF's value head): a biased head's [1, T, 1] output is a view of its
    # addmm, which FSDP2 flags since in-place ops on it would skip its backward hook.
    config.token_classification_bias = False
    return AutoModelForTokenClassification.from_pretrained(
        model_dir, config=config, dtype=torch.float32, attn_implementation=attn_implementation
    )


class FSDPValueBackend(FSDPBackend):
    """A `ValueBackend` over FSDP2; same constructor as `FSDPBackend`."""

    def _load_model(self, model_dir: str, attn_implementation: str) -> Any:
        return load_value_model(model_dir, attn_implementation)

    def _head_plan(self) -> dict[str, ParallelStyle]:
        return {"score": Replicated()}

    def _vocab_shard(self, model: Any, tp_mesh: DeviceMesh) -> VocabShard | None:
        return None  # the values are whole on every tensor rank

    def _per_position(
        self, logits: torch.Tensor, targets_1T: torch.Tensor, temp: float | torch.Tensor
    ) -> torch.Tensor:
        return logits[..., 0].float()

    def forward_values(
        self, seqs: Sequence[TrainSequence], *, token_budget: int = 8192
    ) -> list[list[float]]:
        """Value of every token's preceding state, without grad; entry 0 is 0."""
        return self._score(seqs, 1.0, token_budget)

    def forward_logprobs(
        self, seqs: Sequence[TrainSequence], temperature: float, *, token_budget: int = 8192
    ) -> list[list[float]]:
        raise TypeError("a value model has no logprobs: call forward_values")
