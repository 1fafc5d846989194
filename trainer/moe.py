"""Router math of mixture-of-experts training: the load-balancing loss and the router statistics.

Pure functions of one layer's router output on one packed row, plus `RouterRecorder`, which
collects that output from every MoE layer of a Hugging Face model during a forward pass.

Legend: N = tokens of the row, E = experts, k = experts per token (top-k).

The balance loss is per sequence (DeepSeek-V3's sequence-wise balance loss), so that it is a sum
over sequences and does not depend on how sequences are packed into rows or spread over data
ranks: one process and many compute the same loss. For a sequence s of T tokens and one layer,

    f_e = E / (k T) * #{(t, j) : token t of s sends its j-th choice to expert e}
    P_e = 1 / T * sum_t softmax(router_logits_t)_e
    L_s = sum_e f_e P_e

which is 1 when the router spreads the sequence's tokens evenly and its probabilities are flat,
and grows as tokens pile onto experts that the router also favours (f is counted, so only P
carries a gradient, as in Switch Transformer). A sequence's loss is the mean of L_s over the
layers; the batch's is the mean over its sequences, weighted by the trainer's `aux_loss_coef`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


def sequence_balance_loss(
    router_logits_NE: torch.Tensor,
    top_k_index_Nk: torch.Tensor,
    seq_index_N: torch.Tensor,
    num_seqs: int,
) -> torch.Tensor:
    """L_s (module docstring) of every sequence of the row, [num_seqs] float32, differentiable in
    the logits. `seq_index_N` is each token's sequence (0..num_seqs-1)."""
    num_experts = router_logits_NE.shape[-1]
    k = top_k_index_Nk.shape[-1]
    probs_NE = torch.softmax(router_logits_NE.float(), dim=-1)
    tokens_S = torch.bincount(seq_index_N, minlength=num_seqs).clamp(min=1).float()
    # P: mean router probability of each expert over each sequence's tokens, [S, E]
    prob_sum_SE = probs_NE.new_zeros(num_seqs, num_experts).index_add(0, seq_index_N, probs_NE)
    p_SE = prob_sum_SE / tokens_S[:, None]
    # f: each expert's share of the sequence's k T choices, times E, [S, E] (no gradient)
    with torch.no_grad():
        chosen_NE = torch.zeros_like(probs_NE).scatter_add(
            1, top_k_index_Nk, torch.ones_like(top_k_index_Nk, dtype=probs_NE.dtype)
        )
        count_SE = torch.zeros_like(p_SE).index_add(0, seq_index_N, chosen_NE)
        f_SE = count_SE * (num_experts / k) / tokens_S[:, None]
    return (f_SE * p_SE).sum(-1)


def expert_counts(top_k_index_Nk: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens routed to each expert (a token counts once for each of its k choices), [E] int64."""
    return torch.bincount(top_k_index_Nk.reshape(-1), minlength=num_experts)


def load_range(counts_LE: torch.Tensor) -> tuple[float, float]:
    """(min, max) over layers and experts of an expert's load relative to an even split: its
    tokens over the layer's mean tokens per expert (1 is perfect balance). (1, 1) when no token
    was routed."""
    counts = counts_LE.double()
    mean_L1 = counts.mean(-1, keepdim=True)
    if not bool((mean_L1 > 0).all()):
        return 1.0, 1.0
    load = counts / mean_L1
    return float(load.min()), float(load.max())


@dataclass
class RouterRecorder:
    """Collects every MoE layer's router output during the forward passes it is `armed` for.

    `attach` hooks the routers (`gate` of each sparse block) of a Hugging Face MoE model. While
    armed with a row's sequence layout, each router's forward appends its layer's balance losses
    (with grad) to `balance` and adds its expert counts to `counts_LE`; unarmed (the empty
    passes that only keep collectives in step, forward passes without training) it records
    nothing.
    """

    num_layers: int
    num_experts: int
    counts_LE: torch.Tensor = field(init=False)
    """Tokens per expert of each layer over the passes recorded since `reset`."""
    balance: list[torch.Tensor] = field(default_factory=list)
    """Per-layer [num_seqs] balance losses of the armed pass, in layer order."""
    _row: tuple[torch.Tensor, int] | None = None

    def __post_init__(self) -> None:
        self.counts_LE = torch.zeros(self.num_layers, self.num_experts, dtype=torch.int64)

    def attach(self, routers: list[torch.nn.Module]) -> None:
        """Hooks `routers` (one per layer, in layer order); each returns (logits, weights,
        indices) as transformers' top-k routers do."""
        assert len(routers) == self.num_layers
        for layer, router in enumerate(routers):
            router.register_forward_hook(self._hook(layer))

    def _hook(self, layer: int) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if self._row is None:
                return
            seq_index_N, num_seqs = self._row
            logits_NE, _, index_Nk = output
            self.balance.append(sequence_balance_loss(logits_NE, index_Nk, seq_index_N, num_seqs))
            self.counts_LE[layer] += expert_counts(index_Nk.detach(), self.num_experts).cpu()

        return hook

    def reset(self) -> None:
        """Clears the counts (at the start of an optimizer step)."""
        self.counts_LE.zero_()
        self.balance.clear()

    def arm(self, seq_index_N: torch.Tensor, num_seqs: int) -> None:
        """Records the next forward pass, of a row whose tokens belong to `num_seqs` sequences as
        `seq_index_N` says."""
        self.balance.clear()
        self._row = (seq_index_N, num_seqs)

    def disarm(self) -> torch.Tensor | None:
        """Stops recording; the armed pass's balance loss of each sequence, the mean over layers
        ([num_seqs], with grad), or None if it recorded no layer."""
        self._row = None
        if not self.balance:
            return None
        per_seq = torch.stack(self.balance).mean(0)
        self.balance.clear()
        return per_seq
