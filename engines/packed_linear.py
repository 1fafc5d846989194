"""Projections of the local engine with their weights prepacked for the CPU's matmul kernels.

On a CPU, `torch.nn.functional.linear` hands the weight to its GEMM in the module's plain row-major
layout, and the GEMM reorders it into its blocked layout on every call: for a decode step that
reads every weight once, that reorder is a second pass over the weights. oneDNN takes a weight
reordered once (`torch.ops.mkldnn._reorder_linear_weight`, what inductor's freezing pass does)
and multiplies by it directly (`torch.ops.mkldnn._linear_pointwise`). Measured on the 2-core AMD
EPYC here over SmolLM2-135M's shapes (BENCHMARKS.md, "The local engine on SmolLM2"): 1.6-2x the
float32 matmuls and 1.2-1.8x the bfloat16 ones, the 49,152-word LM head 2-4x.

`FusedLinear` also joins projections that read the same input into one matmul (q, k and v; an
MLP's gate and up), which halves the calls per layer. The packed copy is the engine's own: the
Hugging Face modules keep their weights (a weight update copies into them), and `repack` makes
the copies again after one. Elsewhere (CUDA, or a torch without oneDNN) the modules run as they
are.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN prepacked linears run here (a CPU with oneDNN, float32 or bfloat16)."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    try:
        w = torch.ones(4, 8, dtype=dtype)
        out = torch.ops.mkldnn._linear_pointwise(
            torch.ones(2, 8, dtype=dtype),
            torch.ops.mkldnn._reorder_linear_weight(w, 2),
            None,
            "none",
            [],
            "",
        )
    except (RuntimeError, AttributeError):
        return False
    return bool(torch.equal(out, torch.full((2, 4), 8.0, dtype=dtype)))


class FusedLinear:
    """`modules` (linears of one input width) applied to one input as one matmul; returns each
    module's output, in order (one tensor when there is one module)."""

    def __init__(self, modules: Sequence[nn.Linear], *, packed: bool, batch_hint: int) -> None:
        assert modules, "FusedLinear needs at least one module"
        self.modules = list(modules)
        self.sizes = [m.out_features for m in self.modules]
        self.packed = packed
        self.batch_hint = batch_hint
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.repack()

    def repack(self) -> None:
        """Rebuild the packed weight from the modules' current ones (after a weight update)."""
        if not self.packed:
            return
        with torch.no_grad():
            w = torch.cat([m.weight for m in self.modules])  # a copy even of one: freed below
            self.bias = None
            if any(m.bias is not None for m in self.modules):
                self.bias = torch.cat(
                    [torch.zeros(m.out_features, dtype=w.dtype) if m.bias is None else m.bias
                     for m in self.modules]
                )  # fmt: skip
            self.weight = torch.ops.mkldnn._reorder_linear_weight(w, self.batch_hint)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.weight is None:
            return tuple(m(x) for m in self.modules)
        out = torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return tuple(out.split(self.sizes, dim=-1)) if len(self.sizes) > 1 else (out,)


def gated_mlp(
    gate_up: FusedLinear, down: FusedLinear, act: nn.Module, x: torch.Tensor
) -> torch.Tensor:
    """A Llama-style MLP, `down(act(gate(x)) * up(x))`, on fused linears."""
    gate, up = gate_up(x)
    (out,) = down(act(gate) * up)
    return out
