"""Dense tensor parallelism of a Hugging Face decoder over the `tp` mesh (DTensor), before FSDP2.

The split is Megatron's, written with DTensor's parallel styles as torchtitan's `apply_tp` does,
over Hugging Face's module names:

- attention: `q_proj`, `k_proj`, `v_proj` colwise, so each tensor rank computes its own heads
  (transformers reshapes projections with -1 heads, so attention runs unchanged on the local
  heads), and `o_proj` rowwise: one all-reduce gives every tensor rank the full output;
- MLP: `gate_proj`, `up_proj` colwise, `down_proj` rowwise (one all-reduce);
- the embedding: split over the hidden dimension and all-gathered, which is exact and keeps the
  full-vocabulary `padding_idx` handling of its gradient (a split over the vocabulary would apply
  the global pad id to each rank's local rows);
- the LM head: colwise over the vocabulary, its output left as this rank's slice of the logits,
  from which `trainer.parallel.vocab` computes logprobs and entropies without gathering it;
- every other parameter (the RMSNorms, Qwen3's per-head `q_norm`/`k_norm`, a value head) is
  replicated over the tensor ranks as a DTensor (`Replicated`). Every parameter is then a DTensor
  on the tensor mesh, and after `fully_shard` on the (dp, tp) mesh: the optimizer's foreach
  kernels and the gradient-norm reduction refuse parameters on different meshes.

No sequence parallelism: the norms and residuals between the matmuls run on the whole sequence
on every tensor rank. Sequence parallelism would split those activations (and the norm compute)
over the tensor ranks, trading each all-reduce for a reduce-scatter and an all-gather of the same
volume; it pays in activation memory at long sequences, at the price of sharding the packed row
and passing the layers' keyword inputs through DTensor layouts. It is not done here.

`LAYER_PLANS` says which architectures (`config.model_type`) have a plan; `check_model_fits`
refuses the others, tied embeddings and head counts the tensor size does not divide, before any
weights load.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from trainer.parallel.strategy import ParallelStrategy, validate_for_model


class Replicated(ParallelStyle):
    """A module whose parameters are replicated over the tensor mesh. Its first input is declared
    as `input_layout`: Replicate (the same on every tensor rank, as the residual stream is) or
    Shard(d) (each rank's slice along d, as per-head activations are), and its output comes back as
    this rank's local tensor. A parameter gradient that sums over a sharded dimension is Partial,
    which FSDP2 all-reduces over the tensor ranks before its reduce-scatter."""

    def __init__(self, input_layout: Placement | None = None) -> None:
        super().__init__()
        self.input_layout = input_layout or Replicate()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        layout = (self.input_layout,)

        # Any, not the tuple it is: distribute_module types its hooks as returning None
        def to_dtensor(_: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> Any:
            first = DTensor.from_local(inputs[0], mesh, layout, run_check=False)
            return (first, *inputs[1:])

        def to_local(_: nn.Module, output: DTensor, mesh: DeviceMesh) -> Any:
            return output.to_local()

        return distribute_module(module, device_mesh, None, to_dtensor, to_local)


def _dense_layer() -> dict[str, ParallelStyle]:
    """A Llama-style decoder layer (Llama, Qwen2)."""
    return {
        "input_layernorm": Replicated(),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "post_attention_layernorm": Replicated(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }


def _qk_norm_layer() -> dict[str, ParallelStyle]:
    """Qwen3: a dense layer plus RMSNorms over each head's dimension, applied to the
    [B, T, heads, head_dim] projections, whose heads (dim 2) are split over the tensor ranks."""
    return _dense_layer() | {
        "self_attn.q_norm": Replicated(Shard(2)),
        "self_attn.k_norm": Replicated(Shard(2)),
    }


LAYER_PLANS: dict[str, Callable[[], dict[str, ParallelStyle]]] = {
    "llama": _dense_layer,
    "qwen2": _dense_layer,
    "qwen3": _qk_norm_layer,
}
"""`config.model_type` -> the plan of one of its decoder layers (fresh styles per call)."""


def check_model_fits(strategy: ParallelStrategy, config: Any) -> None:
    """ValueError unless `strategy` can split the model of Hugging Face `config`: its heads
    (`validate_for_model`) and, under tensor parallelism, an architecture of `LAYER_PLANS` with
    untied input and output embeddings."""
    validate_for_model(
        strategy,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        num_experts=getattr(config, "num_experts", None),
    )
    if strategy.tensor == 1:
        return
    if config.model_type not in LAYER_PLANS:
        raise ValueError(
            f"tensor parallel t{strategy.tensor} has plans for {', '.join(sorted(LAYER_PLANS))} "
            f"models; this one is {config.model_type!r}: train it data parallel (fsdp)"
        )
    if config.tie_word_embeddings:
        raise ValueError(
            f"tensor parallel t{strategy.tensor} needs untied input and output embeddings (the "
            "embedding is split over the hidden size, the LM head over the vocabulary); this "
            "model ties them (tie_word_embeddings): train it data parallel (fsdp)"
        )


def apply_tensor_parallel(
    model: nn.Module, tp_mesh: DeviceMesh, head_plan: dict[str, ParallelStyle]
) -> None:
    """Splits `model` (a Hugging Face model that `check_model_fits` accepted) over `tp_mesh` in
    place: the backbone as the module docstring says, and the output head by `head_plan` (keys
    relative to `model`). Every parameter ends up a DTensor on `tp_mesh` (asserted)."""
    config: Any = model.config
    base: Any = model.base_model
    parallelize_module(
        base,
        tp_mesh,
        {"embed_tokens": ColwiseParallel(output_layouts=Replicate()), "norm": Replicated()},
    )
    for layer in base.layers:
        parallelize_module(layer, tp_mesh, LAYER_PLANS[config.model_type]())
    parallelize_module(model, tp_mesh, head_plan)
    plain = [name for name, p in model.named_parameters() if not isinstance(p, DTensor)]
    assert not plain, f"the {config.model_type} tensor-parallel plan leaves {plain} unplaced"
