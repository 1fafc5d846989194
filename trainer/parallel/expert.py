"""Expert parallelism: the experts of every MoE layer split over an expert group, tokens sent to
them and back in all-to-alls.

Expert parallelism adds no ranks (`trainer.parallel.strategy`): the D data ranks regroup into
D / e groups of e consecutive ranks. `expert_mesh` is that regrouping as a 2-D mesh
(`efsdp`, `ep`): within an `ep` group each rank holds E / e of the E experts (rank r the
experts r E / e up to (r + 1) E / e), and FSDP shards each expert's weights over `efsdp`, the
D / e ranks that hold the same experts (torchtitan's `dp_shard_mod_ep`), as it shards the dense
weights over all D.

`ExpertParallelExperts` replaces a Hugging Face sparse block's `experts` (transformers' fused
layout: `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I], so state dicts keep their names and
shapes) and takes the same arguments, the router's top-k choices. Its forward, dropless:

1. dispatch: the row's N k (token, choice) pairs sorted by expert (stable, so in token order
   within one), each rank's count per expert exchanged (an all-to-all of E / e counts per rank),
   then the pairs' hidden states all-to-all'd to the ranks that hold their experts;
2. each local expert's SwiGLU MLP on the tokens it received, from every rank of the group;
3. combine: the outputs all-to-all'd back, weighted by the router's weights and summed per token
   in expert order, as transformers' eager experts add them.

The all-to-alls are differentiable (the backward sends gradients the opposite way), and every
local expert runs even on no tokens, so each rank's expert weights get a gradient, of zeros if
no token came. The expert weights are DTensors sharded over `ep` (dimension 0). A rank's
gradient of its experts sums the contributions of every rank of its group, e ranks' losses, and
FSDP averages it over the D / e ranks of `efsdp`; the forward divides the expert weights'
gradient by e (an identity whose backward scales), so that they get the average over all D
ranks' losses that the dense weights get. (FSDP's own `set_gradient_divide_factor` would do it in
the reduce-scatter, but that needs a pre-multiplied sum, which gloo lacks.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor


def expert_mesh(data: int, expert: int, device_type: str) -> DeviceMesh:
    """The (`efsdp`, `ep`) mesh of `data` data ranks regrouped into groups of `expert` (module
    docstring); every rank of the default group calls it."""
    if data % expert:
        raise ValueError(f"expert size {expert} must divide the {data} data ranks")
    return init_device_mesh(device_type, (data // expert, expert), mesh_dim_names=("efsdp", "ep"))


class _AllToAllV(torch.autograd.Function):
    """Uneven all-to-all of rows: `input_splits[j]` rows to rank j, `output_splits[j]` from it."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        group: Any,
    ) -> torch.Tensor:
        ctx.splits = (output_splits, input_splits)  # type: ignore[attr-defined]
        ctx.group = group  # type: ignore[attr-defined]
        return _exchange(x, output_splits, input_splits, group)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor, None, None, None]:
        output_splits, input_splits = ctx.splits  # type: ignore[attr-defined]
        return _exchange(grad, input_splits, output_splits, ctx.group), None, None, None  # type: ignore[attr-defined]


class _ScaleGrad(torch.autograd.Function):
    """The identity, whose backward multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, scale: float) -> Any:
        ctx.scale = scale  # type: ignore[attr-defined]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> Any:
        return grad * ctx.scale, None  # type: ignore[attr-defined]


def _exchange(
    x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: Any
) -> torch.Tensor:
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


def all_to_all_rows(
    x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: Any
) -> torch.Tensor:
    """Differentiable uneven all-to-all over `group`: the first `input_splits[0]` rows of `x` to
    rank 0, the next `input_splits[1]` to rank 1, and so on; the rows received, `output_splits[j]`
    from rank j, concatenated in rank order."""
    out = _AllToAllV.apply(x, output_splits, input_splits, group)  # type: ignore[no-untyped-call]
    assert isinstance(out, torch.Tensor)
    return out


class ExpertParallelExperts(nn.Module):
    """A sparse block's experts, split over the `ep` mesh (module docstring). Built from the
    block's full `experts` module, which every rank holds after loading the checkpoint."""

    def __init__(self, experts: Any, ep_mesh: DeviceMesh) -> None:
        super().__init__()
        self.num_experts: int = experts.gate_up_proj.shape[0]
        self.ep_size = ep_mesh.size()
        if self.num_experts % self.ep_size:
            raise ValueError(f"{self.num_experts} experts do not split over {self.ep_size} ranks")
        self.local_experts = self.num_experts // self.ep_size
        self.ep_rank = ep_mesh.get_local_rank()
        self.group = ep_mesh.get_group()
        self.act_fn: Callable[[torch.Tensor], torch.Tensor] = experts.act_fn
        self.gate_up_proj = nn.Parameter(
            distribute_tensor(experts.gate_up_proj.detach(), ep_mesh, [Shard(0)])
        )
        self.down_proj = nn.Parameter(
            distribute_tensor(experts.down_proj.detach(), ep_mesh, [Shard(0)])
        )

    def _local(self, param: torch.Tensor) -> torch.Tensor:
        """This rank's experts of a weight, [E / e, ...], its gradient divided by e (module
        docstring)."""
        local = param.to_local() if isinstance(param, DTensor) else param
        if self.ep_size == 1:
            return local
        scaled = _ScaleGrad.apply(local, 1.0 / self.ep_size)  # type: ignore[no-untyped-call]
        assert isinstance(scaled, torch.Tensor)
        return scaled

    def forward(
        self, hidden_NH: torch.Tensor, top_k_index_Nk: torch.Tensor, top_k_weights_Nk: torch.Tensor
    ) -> torch.Tensor:
        k = top_k_index_Nk.shape[-1]
        e, local = self.ep_size, self.local_experts
        flat_expert = top_k_index_Nk.reshape(-1)
        # 1. dispatch: the (token, choice) pairs grouped by expert, so by destination rank
        order = torch.argsort(flat_expert, stable=True)
        token_of = order // k
        counts_E = torch.bincount(flat_expert, minlength=self.num_experts)
        received_eX = torch.empty_like(counts_E).view(e, local)  # [source rank, local expert]
        dist.all_to_all_single(received_eX, counts_E.view(e, local), group=self.group)
        input_splits = counts_E.view(e, local).sum(1).tolist()
        output_splits = received_eX.sum(1).tolist()
        routed = all_to_all_rows(hidden_NH[token_of], output_splits, input_splits, self.group)

        # 2. the local experts, each on its tokens from every source rank
        row_expert = torch.repeat_interleave(
            torch.arange(local, device=routed.device).repeat(e), received_eX.reshape(-1)
        )
        by_expert = torch.argsort(row_expert, stable=True)
        gate_up, down = self._local(self.gate_up_proj), self._local(self.down_proj)
        chunks = torch.split(routed[by_expert], received_eX.sum(0).tolist())
        outputs = []
        for j, x in enumerate(chunks):
            gate, up = nn.functional.linear(x, gate_up[j]).chunk(2, dim=-1)
            outputs.append(nn.functional.linear(self.act_fn(gate) * up, down[j]))
        expert_out = torch.cat(outputs).index_select(0, torch.argsort(by_expert))

        # 3. combine: back to the source ranks, weighted, summed per token in expert order
        back = all_to_all_rows(expert_out, input_splits, output_splits, self.group)
        weights = top_k_weights_Nk.reshape(-1)[order]
        out = torch.zeros_like(hidden_NH)
        return out.index_add(0, token_of, (back * weights[:, None]).to(out.dtype))


MOE_BLOCKS: dict[str, str] = {"qwen3_moe": "Qwen3MoeSparseMoeBlock"}
"""Model type -> the class name of its sparse MoE block, whose `experts` expert parallelism
replaces and whose `gate` (the top-k router) the router recorder hooks."""


def check_moe_model(config: Any) -> None:
    """ValueError unless Hugging Face `config` is of a model type with an entry in `MOE_BLOCKS`."""
    if config.model_type not in MOE_BLOCKS:
        raise ValueError(
            f"the archon backend trains {', '.join(sorted(MOE_BLOCKS))} models; this one is "
            f"{config.model_type!r}: train a dense model with fsdp"
        )


def moe_blocks(model: Any) -> list[Any]:
    """The sparse MoE blocks of a Hugging Face model (`check_moe_model`), in layer order."""
    check_moe_model(model.config)
    name = MOE_BLOCKS[model.config.model_type]
    blocks = [m for m in model.modules() if type(m).__name__ == name]
    if not blocks:
        raise ValueError(f"this {model.config.model_type} model has no {name} layers")
    return blocks


def apply_expert_parallel(blocks: list[Any], ep_mesh: DeviceMesh) -> list[ExpertParallelExperts]:
    """Replaces the `experts` of every block by `ExpertParallelExperts` over `ep_mesh` (also for
    one rank, so that one process runs the same code); returns the new experts modules."""
    replaced = []
    for block in blocks:
        experts = ExpertParallelExperts(block.experts, ep_mesh)
        block.experts = experts
        replaced.append(experts)
    return replaced
