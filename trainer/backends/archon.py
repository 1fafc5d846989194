"""The MoE training backend (`archon`, after AReaL's MoE engine): expert parallel over FSDP2.

`ArchonBackend` is `FSDPBackend` (packing, data parallelism, gradient accumulation, the LR
schedule, DCP checkpoints with exact resume, the full state dict for publishing) for Hugging Face
mixture-of-experts models (`trainer.parallel.expert.MOE_BLOCKS`), with three things added:

- **Expert parallelism.** With an expert size e the D data ranks regroup into groups of e, and
  each rank of a group holds 1 / e of every layer's experts; tokens go to their experts and back
  in all-to-alls (`trainer.parallel.expert`). FSDP2 shards the dense weights over all D ranks as
  in `fsdp`, and each expert's weights over the D / e ranks that hold it (`efsdp`). Under `e1`
  (the default, and one process) the same code runs with every expert local.
- **The router's balance loss** (`trainer.moe`), per sequence, so that it is the same however
  sequences are packed and spread over ranks, weighted by `aux_loss_coef` (0: a metric only)
  and added to each micro-batch's loss as its sequences' share of the batch mean.
- **Router statistics** of every optimizer step, over all ranks: `moe_balance_loss` (the batch
  mean of the balance loss, before the weight), and `moe_load_min`/`moe_load_max`, the least and
  most tokens an expert of any layer received relative to an even split (1 is perfect balance).
  The backend is dropless (every token reaches its k experts, as in the inference engines, which
  drop nothing either), so there are no dropped tokens to count.

Gradient clipping takes the norm over both meshes (dense and expert weights) as one vector.
Tensor, context and pipeline parallelism are not implemented for MoE models
(`trainer.backends.config.IMPLEMENTED`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from trainer.backends.base import EntropyMode, LossFn
from trainer.backends.fsdp import FSDPBackend, _local
from trainer.backends.fsdp_value import FSDPValueBackend
from trainer.batch import MicroBatch, TrainSequence
from trainer.moe import RouterRecorder, load_range
from trainer.parallel.expert import (
    apply_expert_parallel,
    check_moe_model,
    expert_mesh,
    moe_blocks,
)


class ArchonBackend(FSDPBackend):
    """A `TrainBackend` for MoE models; `FSDPBackend`'s constructor plus `aux_loss_coef`."""

    def __init__(self, model_dir: str | Path, *, aux_loss_coef: float = 0.0, **kwargs: Any) -> None:
        from transformers import AutoConfig

        check_moe_model(AutoConfig.from_pretrained(str(model_dir)))  # before any weights load
        if aux_loss_coef < 0:
            raise ValueError(f"aux_loss_coef must be at least 0, got {aux_loss_coef}")
        self.aux_loss_coef = aux_loss_coef
        self._balance: torch.Tensor | None = None
        self._balance_total = 0.0
        self.router_counts = torch.zeros(0, dtype=torch.int64)
        """Tokens each expert of each layer received in the last optimizer step, over all ranks
        ([layers, experts])."""
        super().__init__(model_dir, **kwargs)

    def _shard(self, model: Any, mesh: DeviceMesh, mp: MixedPrecisionPolicy) -> None:
        blocks = moe_blocks(model)
        emesh = expert_mesh(self.dp_size, self.strategy.expert, self.device.type)
        experts = apply_expert_parallel(blocks, emesh["ep"])
        for module in experts:
            fully_shard(module, mesh=emesh["efsdp"], mp_policy=mp)
        self._expert_params = [p for module in experts for p in module.parameters()]
        self.router = RouterRecorder(len(blocks), experts[0].num_experts)
        self.router.attach([block.gate for block in blocks])
        super()._shard(model, mesh, mp)
        expert_ids = {id(p) for p in self._expert_params}
        self._dense_params = [p for p in model.parameters() if id(p) not in expert_ids]

    def _row(
        self, mb: MicroBatch, temperature: float, entropy: EntropyMode
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.model.training:
            return super()._row(mb, temperature, entropy)
        self.router.arm(mb.seq_index_1T.reshape(-1), len(mb.seq_lens))
        try:
            return super()._row(mb, temperature, entropy)
        finally:
            self._balance = self.router.disarm()

    def _auxiliary_loss(self, num_seqs: int) -> torch.Tensor | None:
        balance, self._balance = self._balance, None
        assert balance is not None, "the micro-batch's forward recorded no router"
        self._balance_total += float(balance.detach().sum())
        if self.aux_loss_coef == 0:
            return None
        return self.aux_loss_coef * balance.sum() / num_seqs

    def _clip_grad_norm(self, max_norm: float) -> float:
        groups = [self._dense_params, self._expert_params]
        norms = [
            _local(torch.nn.utils.get_total_norm([p.grad for p in g if p.grad is not None]))
            for g in groups
        ]
        total = torch.stack(norms).square().sum().sqrt()
        for group in groups:
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
        return float(total)

    def train_step(
        self, seqs: Sequence[TrainSequence], loss_fn: LossFn, **kwargs: Any
    ) -> dict[str, float]:
        self.router.reset()
        self._balance_total = 0.0
        stats = super().train_step(seqs, loss_fn, **kwargs)
        parts = self._gather((self.router.counts_LE.clone(), self._balance_total))
        self.router_counts = torch.stack([counts for counts, _ in parts]).sum(0)
        low, high = load_range(self.router_counts)
        balance = sum(total for _, total in parts) / len(seqs)
        return stats | {"moe_balance_loss": balance, "moe_load_min": low, "moe_load_max": high}


class ArchonValueBackend(ArchonBackend, FSDPValueBackend):
    """The PPO critic of an MoE policy: `FSDPValueBackend`'s value model under `ArchonBackend`'s
    expert parallelism (its balance loss is a metric of the critic's router, weighted the same)."""
