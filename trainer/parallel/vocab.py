"""Token logprobs and entropies from logits split over the vocabulary (a tensor-parallel LM head).

Under tensor parallelism the LM head is sharded over the vocabulary (`trainer.parallel.tensor`):
each tensor rank holds the logits of one contiguous slice of the vocabulary, and no rank ever
holds a row of the full [T, V] logits. The softmax statistics combine across the slices exactly
(Megatron's vocab-parallel cross entropy). With z = logits / temperature at each position:

- m = the max over ranks of each slice's max of z (one all-reduce, MAX);
- S = the sum over ranks of each slice's sum of exp(z - m), together with the target's z from the
  rank whose slice holds it (0 on the others) for a logprob, or W = the sum of
  exp(z - m) (z - m) for an entropy (one all-reduce, SUM, of both rows at once);
- logsumexp = m + log S, logp(target) = z_target - logsumexp, entropy = log S - W / S.

Backward needs no communication: d logp / d z_j = onehot_j - p_j and dH / d z_j = -p_j (log p_j +
H), with p_j = exp(z_j - logsumexp), are local to the slice once the forward has kept logsumexp
(and H). Both passes go a chunk of positions at a time, like `trainer.batch.token_logprobs`, so
memory stays flat in the vocabulary, and temperatures work as there (one number or one per
position).

Uneven vocabularies (the tiny model's 263 ids over 2 ranks) are not padded: the slices follow
DTensor's `Shard` layout, ceil(V / n) ids per rank with the last ranks shorter (or empty), which
`vocab_slice` computes.

The `shard_*` functions and the two `*_from_partials` are the per-slice math, pure and free of
collectives, so a test can run them on simulated slices; `vocab_parallel_logprobs` and
`vocab_parallel_entropy` put the all-reduces between them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from trainer.batch import per_position_temperature


@dataclass(frozen=True, slots=True)
class VocabShard:
    """This rank's slice [start, end) of a vocabulary of `size` ids, split over `group`."""

    start: int
    end: int
    size: int
    group: dist.ProcessGroup


def vocab_slice(size: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of slice `index` of `size` ids cut into `parts`, as DTensor's `Shard` lays a
    dimension out: ceil(size / parts) ids per slice, the last slices shorter or empty."""
    step = -(-size // parts)
    start = min(index * step, size)
    return start, min(start + step, size)


def vocab_shard(size: int, mesh: DeviceMesh) -> VocabShard:
    """This rank's slice of a `size`-id vocabulary sharded over the 1-D `mesh`."""
    start, end = vocab_slice(size, mesh.size(), mesh.get_local_rank())
    return VocabShard(start=start, end=end, size=size, group=mesh.get_group())


# -- the per-slice math ------------------------------------------------------------------------


def _scaled(logits_TV: torch.Tensor, temp_T: torch.Tensor, s: int, chunk: int) -> torch.Tensor:
    """z = logits / temperature of positions [s, s + chunk), in the temperatures' dtype."""
    return logits_TV[s : s + chunk].to(temp_T.dtype) / temp_T[s : s + chunk, None]


def shard_max(logits_TV: torch.Tensor, temp_T: torch.Tensor, chunk: int) -> torch.Tensor:
    """[T] max of z over this slice's ids (-inf for an empty slice)."""
    m_T = torch.full_like(temp_T, -math.inf)
    if logits_TV.shape[1]:
        for s in range(0, logits_TV.shape[0], chunk):
            m_T[s : s + chunk] = _scaled(logits_TV, temp_T, s, chunk).amax(-1)
    return m_T


def shard_logprob_partials(
    logits_TV: torch.Tensor,
    targets_T: torch.Tensor,
    start: int,
    temp_T: torch.Tensor,
    m_T: torch.Tensor,
    chunk: int,
) -> torch.Tensor:
    """[2, T]: this slice's sum of exp(z - m), and z at the target where the target (a global
    id) falls in the slice, 0 where it does not. `m_T` is the max over every slice."""
    n, v = logits_TV.shape
    out_2T = torch.zeros((2, n), dtype=temp_T.dtype, device=logits_TV.device)
    local_T = targets_T - start
    held_T = (local_T >= 0) & (local_T < v)
    if v == 0:
        return out_2T
    index_T = local_T.clamp(0, v - 1)
    for s in range(0, n, chunk):
        z = _scaled(logits_TV, temp_T, s, chunk)
        out_2T[0, s : s + chunk] = torch.exp(z - m_T[s : s + chunk, None]).sum(-1)
        picked = z.gather(-1, index_T[s : s + chunk, None]).squeeze(-1)
        out_2T[1, s : s + chunk] = torch.where(held_T[s : s + chunk], picked, 0.0)
    return out_2T


def shard_entropy_partials(
    logits_TV: torch.Tensor, temp_T: torch.Tensor, m_T: torch.Tensor, chunk: int
) -> torch.Tensor:
    """[2, T]: this slice's sum of exp(z - m) and of exp(z - m) (z - m); `m_T` is the max over
    every slice (so z - m <= 0: no cancellation between large terms)."""
    n = logits_TV.shape[0]
    out_2T = torch.zeros((2, n), dtype=temp_T.dtype, device=logits_TV.device)
    if logits_TV.shape[1] == 0:
        return out_2T
    for s in range(0, n, chunk):
        shifted = _scaled(logits_TV, temp_T, s, chunk) - m_T[s : s + chunk, None]
        e = torch.exp(shifted)
        out_2T[0, s : s + chunk] = e.sum(-1)
        out_2T[1, s : s + chunk] = (e * shifted).sum(-1)
    return out_2T


def logprobs_from_partials(
    m_T: torch.Tensor, partials_2T: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp of the target, logsumexp of z), both [T], from the global max and the summed
    `shard_logprob_partials` of every slice."""
    lse_T = m_T + torch.log(partials_2T[0])
    return partials_2T[1] - lse_T, lse_T


def entropy_from_partials(
    m_T: torch.Tensor, partials_2T: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(entropy of softmax(z), logsumexp of z), both [T], from the global max and the summed
    `shard_entropy_partials` of every slice."""
    log_s_T = torch.log(partials_2T[0])
    return log_s_T - partials_2T[1] / partials_2T[0], m_T + log_s_T


def shard_logprob_grad(
    logits_TV: torch.Tensor,
    targets_T: torch.Tensor,
    start: int,
    temp_T: torch.Tensor,
    lse_T: torch.Tensor,
    grad_T: torch.Tensor,
    chunk: int,
) -> torch.Tensor:
    """d(sum grad * logp) / d logits for this slice: (onehot(target) - p) * grad / temperature,
    with p = exp(z - logsumexp); the onehot is zero where another slice holds the target."""
    n, v = logits_TV.shape
    grad_TV = torch.empty_like(logits_TV)
    if v == 0:
        return grad_TV
    local_T = targets_T - start
    held_T = (local_T >= 0) & (local_T < v)
    index_T = local_T.clamp(0, v - 1)
    for s in range(0, n, chunk):
        t_T1 = temp_T[s : s + chunk, None]
        g_T = grad_T[s : s + chunk].to(lse_T.dtype)
        probs = torch.exp(_scaled(logits_TV, temp_T, s, chunk) - lse_T[s : s + chunk, None])
        g_TV = -probs * g_T[:, None]
        own_T = torch.where(held_T[s : s + chunk], g_T, 0.0)
        g_TV.scatter_add_(-1, index_T[s : s + chunk, None], own_T[:, None])
        grad_TV[s : s + chunk] = g_TV / t_T1
    return grad_TV


def shard_entropy_grad(
    logits_TV: torch.Tensor,
    temp_T: torch.Tensor,
    lse_T: torch.Tensor,
    h_T: torch.Tensor,
    grad_T: torch.Tensor,
    chunk: int,
) -> torch.Tensor:
    """d(sum grad * H) / d logits for this slice: -p (log p + H) * grad / temperature."""
    grad_TV = torch.empty_like(logits_TV)
    for s in range(0, logits_TV.shape[0], chunk):
        t_T1 = temp_T[s : s + chunk, None]
        logp = _scaled(logits_TV, temp_T, s, chunk) - lse_T[s : s + chunk, None]
        g_T1 = grad_T[s : s + chunk].to(h_T.dtype)[:, None]
        grad_TV[s : s + chunk] = -g_T1 * logp.exp() * (logp + h_T[s : s + chunk, None]) / t_T1
    return grad_TV


# -- with the all-reduces ----------------------------------------------------------------------


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        logits_TV: torch.Tensor,
        targets_T: torch.Tensor,
        temp_T: torch.Tensor,
        shard: VocabShard,
        chunk: int,
    ) -> torch.Tensor:
        m_T = shard_max(logits_TV, temp_T, chunk)
        dist.all_reduce(m_T, op=dist.ReduceOp.MAX, group=shard.group)
        partials_2T = shard_logprob_partials(logits_TV, targets_T, shard.start, temp_T, m_T, chunk)
        dist.all_reduce(partials_2T, group=shard.group)
        logp_T, lse_T = logprobs_from_partials(m_T, partials_2T)
        ctx.save_for_backward(logits_TV, targets_T, temp_T, lse_T)
        ctx.start = shard.start  # type: ignore[attr-defined]
        ctx.chunk = chunk  # type: ignore[attr-defined]
        return logp_T

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_T: torch.Tensor
    ) -> tuple[torch.Tensor, None, None, None, None]:
        logits_TV, targets_T, temp_T, lse_T = ctx.saved_tensors  # type: ignore[attr-defined]
        start: int = ctx.start  # type: ignore[attr-defined]
        chunk: int = ctx.chunk  # type: ignore[attr-defined]
        grad_TV = shard_logprob_grad(logits_TV, targets_T, start, temp_T, lse_T, grad_T, chunk)
        return grad_TV, None, None, None, None


class _VocabParallelEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        logits_TV: torch.Tensor,
        temp_T: torch.Tensor,
        shard: VocabShard,
        chunk: int,
    ) -> torch.Tensor:
        m_T = shard_max(logits_TV, temp_T, chunk)
        dist.all_reduce(m_T, op=dist.ReduceOp.MAX, group=shard.group)
        partials_2T = shard_entropy_partials(logits_TV, temp_T, m_T, chunk)
        dist.all_reduce(partials_2T, group=shard.group)
        h_T, lse_T = entropy_from_partials(m_T, partials_2T)
        ctx.save_for_backward(logits_TV, temp_T, lse_T, h_T)
        ctx.chunk = chunk  # type: ignore[attr-defined]
        return h_T

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_T: torch.Tensor
    ) -> tuple[torch.Tensor, None, None, None]:
        logits_TV, temp_T, lse_T, h_T = ctx.saved_tensors  # type: ignore[attr-defined]
        chunk: int = ctx.chunk  # type: ignore[attr-defined]
        grad_TV = shard_entropy_grad(logits_TV, temp_T, lse_T, h_T, grad_T, chunk)
        return grad_TV, None, None, None


def _check_slice(logits_1TV: torch.Tensor, shard: VocabShard) -> tuple[int, int, int]:
    b, t, v = logits_1TV.shape
    assert v == shard.end - shard.start, f"logits hold {v} ids, the slice {shard}"
    return b, t, v


def vocab_parallel_logprobs(
    logits_1TV: torch.Tensor,
    targets_1T: torch.Tensor,
    shard: VocabShard,
    temperature: float | torch.Tensor = 1.0,
    chunk: int = 1024,
) -> torch.Tensor:
    """`trainer.batch.token_logprobs` of the full logits, from this rank's slice of them: the same
    [1, T] float32 (float64 for float64 logits) logprobs of the (global) target ids on every rank
    of `shard.group`, differentiable into this rank's slice. Every rank of the group calls it."""
    b, t, v = _check_slice(logits_1TV, shard)
    dtype = torch.promote_types(logits_1TV.dtype, torch.float32)
    temp_T = per_position_temperature(temperature, b * t, dtype, logits_1TV.device)
    logp_T = _VocabParallelLogprobs.apply(  # type: ignore[no-untyped-call]
        logits_1TV.reshape(b * t, v), targets_1T.reshape(b * t), temp_T, shard, chunk
    )
    assert isinstance(logp_T, torch.Tensor)
    return logp_T.reshape(b, t)


def vocab_parallel_entropy(
    logits_1TV: torch.Tensor,
    shard: VocabShard,
    temperature: float | torch.Tensor = 1.0,
    chunk: int = 1024,
) -> torch.Tensor:
    """`trainer.batch.token_entropy` of the full logits, from this rank's slice of them (see
    `vocab_parallel_logprobs`). Every rank of `shard.group` calls it."""
    b, t, v = _check_slice(logits_1TV, shard)
    dtype = torch.promote_types(logits_1TV.dtype, torch.float32)
    temp_T = per_position_temperature(temperature, b * t, dtype, logits_1TV.device)
    h_T = _VocabParallelEntropy.apply(  # type: ignore[no-untyped-call]
        logits_1TV.reshape(b * t, v), temp_T, shard, chunk
    )
    assert isinstance(h_T, torch.Tensor)
    return h_T.reshape(b, t)
