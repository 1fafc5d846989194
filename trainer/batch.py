"""Training sequences, their packing into token-budget micro-batches, and token logprobs.

A `TrainSequence` is one trajectory segment as the trainer sees it: token ids plus per-token
arrays, all indexed by token (the value for token t sits at index t). `pack` puts whole sequences
into micro-batches of one packed row each (first-fit-decreasing under a token budget): no padding,
so no compute is wasted on pad tokens.

**Packed forward.** Each sequence's `position_ids` restart at 0 and no attention mask is passed.
transformers (5.x, `masking_utils.find_packed_sequence_indices`) then reads every position reset as
a sequence boundary and builds a block-diagonal causal mask for the eager and sdpa kernels, so
each sequence gets exactly the logits it would get alone. The model must be called with
`use_cache=False`: with a cache the reset detection is skipped. `tests/unit/trainer/test_batch.py`
holds this to 1e-5. That mask makes attention quadratic in the whole row, so the backend's default
kernel is `trainer.attention.VARLEN` instead, which splits the row at the same resets and attends
per sequence (held to the same 1e-5, gradients included). (flash-attention turns the resets into
varlen `cu_seqlens`; that path needs a GPU and is not exercised here.)

**Shifted alignment.** The logits at row position i predict the token at i + 1, so a micro-batch
stores everything "by predicting position": `targets_1T[i]` is the next token of the same sequence,
and `loss_mask_1T`, `behav_logp_1T`, `advantages_1T`, ... at i are the sequence's values for that
next token. The last position of each sequence predicts nothing: target 0, mask False, values 0
(versions -1). Hence `token_logprobs(logits_1TV, targets_1T)` at i is the logprob of token i + 1,
and `unpack_token_values` turns a row of such values back into per-token lists (0 at token 0).
A sequence's first token has no logprob, so `TrainSequence` requires `loss_mask[0] == 0`.

**Prefix sharing.** `pack(..., prefix_sharing=True)` packs trees (`trainer.prefix`): a sequence
that shares its first tokens with an earlier one in the row (its trunk) starts at its first own
token, at that token's true position, and its tokens before are scored at the trunk's positions
(`MicroBatch.seq_shared`, `seq_trunk`; `unpack_token_values` reads them from there). Every
position still predicts exactly one sequence's next token, so the shifted alignment above and
every loss over positions hold unchanged.
"""

# Shape-suffixed field names (`input_ids_1T`) are our convention, as pyproject's N803/N806 say.

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from trainer.prefix import MIN_SHARED, Member, plan_trees, tree_tokens


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainSequence:
    """One sequence to train on. Invariants (checked): every array has the length of `tokens`
    (at least 1), `loss_mask` is 0/1 with `loss_mask[0] == 0`, and per-token values are meant to be
    0 where the mask is 0 (versions -1)."""

    tokens: list[int]
    """Token ids: prompt, sampled and tool/user tokens of one segment."""
    loss_mask: list[int]
    """1 on sampled (trained) tokens, 0 elsewhere."""
    behav_logprobs: list[float]
    """Behaviour logprob of token t under the engine that sampled it; 0 where the mask is 0."""
    advantages: list[float]
    """Per-token advantage; 0 where the mask is 0."""
    versions: list[int]
    """Policy version that sampled token t; -1 where the mask is 0."""
    ref_logprobs: list[float] | None = None
    """Reference-policy logprob of token t (for a KL term), if computed."""
    prox_logprobs: list[float] | None = None
    """Proximal-policy logprob of token t (decoupled PPO), if computed."""
    values: list[float] | None = None
    """Critic's value of the state before token t when the batch was formed (PPO's old values),
    if a critic is trained; 0 where the mask is 0."""
    returns: list[float] | None = None
    """GAE return (advantage + old value) of token t, the critic's target; 0 where the mask is 0."""
    temperatures: list[float] | None = None
    """The sampling temperature of token t: its logprobs are `log_softmax(logits / T_t)` (the
    turn's own temperature, see `trainer.sequences`); None: the caller's one temperature."""
    constrained: list[bool] | None = None
    """Whether token t was sampled under a grammar (structured outputs): its recorded logprob is
    the masked distribution's, and the trainer puts the proximal one in its place
    (`store.run_config`, "Constrained turns"); None: no token was."""

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if n == 0:
            raise ValueError("a TrainSequence needs at least one token")
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and len(value) != n:
                raise ValueError(f"{f.name} has {len(value)} entries; tokens has {n}")
        if any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError("loss_mask must hold only 0 and 1")
        if self.loss_mask[0]:
            raise ValueError("loss_mask[0] must be 0: the first token has no logprob to train")
        if self.temperatures is not None and any(not t > 0 for t in self.temperatures):
            raise ValueError("temperatures must be positive")

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)


@dataclass(frozen=True, slots=True, kw_only=True)
class MicroBatch:
    """Whole sequences packed into one row (batch dim 1, T = sum of `seq_lens`).

    All `*_1T` tensors have shape [1, T]. Per-token training values are shifted (module
    docstring): entry i belongs to the token at i + 1 of the same sequence, and the last position of
    every sequence is empty (mask False, value 0, version -1, target 0).
    """

    input_ids_1T: torch.Tensor
    """int64 token ids of the sequences, concatenated."""
    position_ids_1T: torch.Tensor
    """int64 positions, restarting at 0 at each sequence start."""
    seq_index_1T: torch.Tensor
    """int64 index (0..n-1, into `seq_lens`) of the sequence each position belongs to."""
    targets_1T: torch.Tensor
    """int64 next token of the same sequence (0 at each sequence's last position)."""
    loss_mask_1T: torch.Tensor
    """bool: the target at i is a trained (sampled) token."""
    behav_logp_1T: torch.Tensor
    """float32 behaviour logprob of the target."""
    advantages_1T: torch.Tensor
    """float32 advantage of the target."""
    versions_1T: torch.Tensor
    """int64 policy version of the target (-1 where untrained)."""
    ref_logp_1T: torch.Tensor | None
    """float32 reference logprob of the target, when every packed sequence has one."""
    prox_logp_1T: torch.Tensor | None
    """float32 proximal logprob of the target, when every packed sequence has one."""
    old_values_1T: torch.Tensor | None
    """float32 old critic value at the position (the state before the target is sampled), when
    every packed sequence has values."""
    returns_1T: torch.Tensor | None
    """float32 return of the target (the critic's regression target), when every packed
    sequence has returns."""
    temperature_1T: torch.Tensor | None
    """float32 sampling temperature of the target, when every packed sequence has temperatures
    (1 at each sequence's last position, which predicts nothing)."""
    seq_lens: tuple[int, ...]
    """Length of each packed sequence, in row order."""
    seq_ids: tuple[int, ...]
    """Index of each packed sequence in the list given to `pack`."""
    seq_shared: tuple[int, ...] = ()
    """Prefix sharing (`trainer.prefix`): leading tokens of each packed sequence read from its
    trunk's positions, 0 for a sequence run whole; empty: none shared."""
    seq_trunk: tuple[int, ...] = ()
    """Prefix sharing: the index (into `seq_lens`) of each sequence's trunk, itself when it
    shares nothing; empty: none shared."""

    @property
    def num_tokens(self) -> int:
        """Row positions: every sequence's tokens less those it reads from its trunk."""
        return sum(self.seq_lens) - sum(self.seq_shared)

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask_1T.sum())

    def to(self, device: torch.device | str) -> MicroBatch:
        """The same micro-batch with every tensor on `device`."""
        moved: dict[str, Any] = {
            f.name: v.to(device)
            for f in fields(self)
            if isinstance(v := getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **moved)


def plan_micro_batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """First-fit-decreasing bin packing of sequence `lengths` into bins of `token_budget` tokens.

    Returns bins of indices into `lengths`; each index appears exactly once. Sequences are placed
    longest first (ties by index) into the first bin with room; one longer than the budget gets a
    bin of its own. Deterministic, so every data-parallel rank can plan every rank's batches.
    """
    if token_budget < 1:
        raise ValueError(f"token_budget must be positive, got {token_budget}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = lengths[i]
        for b, free in enumerate(room):
            if n <= free:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(token_budget - n)
    return bins


def data_shards(lengths: Sequence[int], data_size: int) -> list[list[int]]:
    """The indices of the sequences (of these `lengths`) that each of `data_size` data ranks
    trains on: longest first (ties by index), rank r taking every `data_size`-th from r, so every
    rank gets a similar number of tokens and every rank can compute every rank's share."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return [order[r::data_size] for r in range(data_size)]


def tree_shards(
    seqs: Sequence[TrainSequence], data_size: int, token_budget: int
) -> list[list[int]]:
    """`data_shards` for prefix-shared packing: whole trees (`trainer.prefix.plan_trees` under
    `token_budget`) go to a rank, largest first, each to the rank with the fewest row positions
    so far (ties to the lowest rank), so the sequences that share a prefix stay together. Each
    shard is in ascending index order; a function of its arguments alone, as `data_shards`."""
    trees = plan_trees(seqs, token_budget)
    sizes = [tree_tokens(seqs, t) for t in trees]
    shards: list[list[int]] = [[] for _ in range(data_size)]
    load = [0] * data_size
    for t in sorted(range(len(trees)), key=lambda t: (-sizes[t], t)):
        r = min(range(data_size), key=lambda r: (load[r], r))
        shards[r] += [m.seq for m in trees[t]]
        load[r] += sizes[t]
    return [sorted(shard) for shard in shards]


def split_minibatches(
    lengths: Sequence[int],
    n: int,
    *,
    seed: str,
    units: Sequence[Sequence[int]] | None = None,
) -> list[list[int]]:
    """One epoch's PPO mini-batches of a batch of sequences of these `lengths`: groups of
    indices, balanced by tokens, each in ascending index order. The sequences go in a random
    order (`random.Random(seed).shuffle`), each into the group with the fewest tokens so far
    (ties to the lowest group), so no group holds more than one sequence's length of tokens
    beyond another's, and each epoch mixes its mini-batches anew when each has its own seed (the
    trainer's: `{optim.seed}:{step}:{epoch}`). `units` (a partition of the indices; default each
    index alone) go whole: they are what is shuffled and placed, min(n, len(units)) groups of
    them. A function of its arguments alone, so every rank splits the same way."""
    if n < 1:
        raise ValueError(f"n must be positive, got {n}")
    parts = [[i] for i in range(len(lengths))] if units is None else [list(u) for u in units]
    if sorted(i for u in parts for i in u) != list(range(len(lengths))):
        raise ValueError("units must partition the sequences' indices")
    k = min(n, len(parts))
    groups: list[list[int]] = [[] for _ in range(k)]
    load = [0] * k
    order = list(range(len(parts)))
    random.Random(seed).shuffle(order)
    for u in order:
        g = min(range(k), key=lambda j: (load[j], j))
        groups[g] += parts[u]
        load[g] += sum(lengths[i] for i in parts[u])
    return [sorted(g) for g in groups]


def plan_rows(
    seqs: Sequence[TrainSequence],
    token_budget: int,
    *,
    prefix_sharing: bool = False,
    min_shared: int = MIN_SHARED,
) -> list[list[Member]]:
    """The micro-batches `pack` makes: each a row's sequences, as tree members
    (`trainer.prefix`), trunks before their branches. Flat (`prefix_sharing` off): every
    sequence whole, by `plan_micro_batches`; shared: `plan_trees` under the budget, its trees
    put into rows by the same first-fit-decreasing on their positions."""
    if not prefix_sharing:
        bins = plan_micro_batches([len(s) for s in seqs], token_budget)
        return [[Member(i, 0) for i in ids] for ids in bins]
    trees = plan_trees(seqs, token_budget, min_shared=min_shared)
    bins = plan_micro_batches([tree_tokens(seqs, t) for t in trees], token_budget)
    return [[m for t in ids for m in trees[t]] for ids in bins]


def pack(
    seqs: Sequence[TrainSequence],
    token_budget: int,
    *,
    prefix_sharing: bool = False,
    min_shared: int = MIN_SHARED,
) -> list[MicroBatch]:
    """Packs `seqs` into micro-batches of at most `token_budget` row positions (a longer
    sequence is alone in its own), following `plan_rows`."""
    plan = plan_rows(seqs, token_budget, prefix_sharing=prefix_sharing, min_shared=min_shared)
    return pack_rows(seqs, plan)


def pack_rows(seqs: Sequence[TrainSequence], plan: Sequence[Sequence[Member]]) -> list[MicroBatch]:
    """The micro-batches of a `plan_rows` plan of `seqs`."""
    return [_pack_row(seqs, members) for members in plan]


def _shifted(values: Sequence[float] | Sequence[int], fill: float | int) -> list[float | int]:
    """Per-token values moved to their predicting position: [v1, v2, ..., v_{L-1}, fill]."""
    return [*values[1:], fill]


def _pack_row(seqs: Sequence[TrainSequence], members: Sequence[Member]) -> MicroBatch:
    ids = [m.seq for m in members]
    cut = [m.shared for m in members]  # each sequence's row part starts at its token `shared`
    chosen = [seqs[i] for i in ids]
    cols: dict[str, list[float | int]] = {
        k: [] for k in ("input", "pos", "seq", "tgt", "mask", "behav", "adv", "ver")
    }
    optional = {
        name: [getattr(s, name) for s in chosen]
        for name in ("ref_logprobs", "prox_logprobs", "values", "returns", "temperatures")
    }
    shifted: dict[str, list[float | int] | None] = {
        name: (
            [
                x
                for v, c in zip(per_seq, cut, strict=True)
                for x in _shifted(v, 1.0 if name == "temperatures" else 0.0)[c:]
            ]
            if all(v is not None for v in per_seq)
            else None
        )
        for name, per_seq in optional.items()
    }
    trunk: list[int] = []  # a tree's members are consecutive, its trunk first
    for j, (s, c) in enumerate(zip(chosen, cut, strict=True)):
        trunk.append(j if c == 0 else trunk[-1])
        cols["input"] += s.tokens[c:]
        cols["pos"] += range(c, len(s))
        cols["seq"] += [j] * (len(s) - c)
        cols["tgt"] += _shifted(s.tokens, 0)[c:]
        cols["mask"] += _shifted(s.loss_mask, 0)[c:]
        cols["behav"] += _shifted(s.behav_logprobs, 0.0)[c:]
        cols["adv"] += _shifted(s.advantages, 0.0)[c:]
        cols["ver"] += _shifted(s.versions, -1)[c:]
    shared = any(cut)

    def row(values: list[float | int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).unsqueeze(0)

    def maybe_row(name: str) -> torch.Tensor | None:
        values = shifted[name]
        return None if values is None else row(values, torch.float32)

    return MicroBatch(
        input_ids_1T=row(cols["input"], torch.int64),
        position_ids_1T=row(cols["pos"], torch.int64),
        seq_index_1T=row(cols["seq"], torch.int64),
        targets_1T=row(cols["tgt"], torch.int64),
        loss_mask_1T=row(cols["mask"], torch.bool),
        behav_logp_1T=row(cols["behav"], torch.float32),
        advantages_1T=row(cols["adv"], torch.float32),
        versions_1T=row(cols["ver"], torch.int64),
        ref_logp_1T=maybe_row("ref_logprobs"),
        prox_logp_1T=maybe_row("prox_logprobs"),
        old_values_1T=maybe_row("values"),
        returns_1T=maybe_row("returns"),
        temperature_1T=maybe_row("temperatures"),
        seq_lens=tuple(len(s) for s in chosen),
        seq_ids=tuple(ids),
        seq_shared=tuple(cut) if shared else (),
        seq_trunk=tuple(trunk) if shared else (),
    )


def unpack_token_values(values_1T: torch.Tensor, mb: MicroBatch) -> list[list[float]]:
    """Splits a row of shifted values (e.g. `token_logprobs` output) into per-sequence lists in
    token order: entry t is the value for token t, and entry 0 (no predicting position) is 0."""
    flat = values_1T.reshape(-1).tolist()
    shared = mb.seq_shared or (0,) * len(mb.seq_lens)
    trunk = mb.seq_trunk or tuple(range(len(mb.seq_lens)))
    starts: list[int] = []
    out: list[list[float]] = []
    start = 0
    for j, (n, c) in enumerate(zip(mb.seq_lens, shared, strict=True)):
        starts.append(start)
        # tokens 1..c are predicted at the trunk's positions 0..c-1, the rest at its own
        head = flat[starts[trunk[j]] : starts[trunk[j]] + c]
        out.append([0.0, *head, *flat[start : start + n - c - 1]])
        start += n - c
    return out


def per_position_temperature(
    temperature: float | torch.Tensor, n: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """[n] temperatures from one number or a [1, n] row; raises unless all are positive."""
    if isinstance(temperature, torch.Tensor):
        temp_T = temperature.reshape(-1).to(dtype=dtype, device=device)
        if temp_T.shape[0] != n:
            raise ValueError(f"{temp_T.shape[0]} temperatures for {n} positions")
        if not bool((temp_T > 0).all()):
            raise ValueError("temperatures must be positive")
        return temp_T
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    return torch.full((n,), float(temperature), dtype=dtype, device=device)


class _TokenLogprobs(torch.autograd.Function):
    """log_softmax(logits / T) at the targets (T per position), a chunk of positions at a time.

    Neither pass materialises a float32 copy of the whole [T, V] logits: forward keeps only the
    [T] logsumexp, and backward recomputes the softmax chunk by chunk.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        logits_TV: torch.Tensor,
        targets_T: torch.Tensor,
        temp_T: torch.Tensor,
        chunk: int,
    ) -> torch.Tensor:
        dtype = temp_T.dtype
        lse_T = torch.empty(logits_TV.shape[0], dtype=dtype, device=logits_TV.device)
        logp_T = torch.empty_like(lse_T)
        for s in range(0, logits_TV.shape[0], chunk):
            scaled = logits_TV[s : s + chunk].to(dtype) / temp_T[s : s + chunk, None]
            lse_T[s : s + chunk] = torch.logsumexp(scaled, dim=-1)
            picked = scaled.gather(-1, targets_T[s : s + chunk, None]).squeeze(-1)
            logp_T[s : s + chunk] = picked - lse_T[s : s + chunk]
        ctx.save_for_backward(logits_TV, targets_T, lse_T, temp_T)
        ctx.chunk = chunk  # type: ignore[attr-defined]
        return logp_T

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_T: torch.Tensor
    ) -> tuple[torch.Tensor, None, None, None]:
        logits_TV, targets_T, lse_T, temp_T = ctx.saved_tensors  # type: ignore[attr-defined]
        chunk: int = ctx.chunk  # type: ignore[attr-defined]
        grad_TV = torch.empty_like(logits_TV)
        for s in range(0, logits_TV.shape[0], chunk):
            g_T = grad_T[s : s + chunk].to(lse_T.dtype)
            t_T1 = temp_T[s : s + chunk, None]
            probs = torch.exp(
                logits_TV[s : s + chunk].to(lse_T.dtype) / t_T1 - lse_T[s : s + chunk, None]
            )
            # d logp / d logits = (onehot(target) - softmax) / temperature
            g_TV = -probs * g_T[:, None]
            g_TV.scatter_add_(-1, targets_T[s : s + chunk, None], g_T[:, None])
            grad_TV[s : s + chunk] = g_TV / t_T1
        return grad_TV, None, None, None


def token_logprobs(
    logits_1TV: torch.Tensor,
    targets_1T: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    chunk: int = 1024,
) -> torch.Tensor:
    """`log_softmax(logits / temperature)` gathered at `targets`, shape [1, T], computed and
    returned in float32 (float64 for float64 logits). `temperature` is one number or a [1, T]
    row (a `MicroBatch.temperature_1T`: each target at the temperature that sampled it).

    Differentiable, and memory-light for large vocabularies (see `_TokenLogprobs`). With the
    shifted targets of a `MicroBatch`, entry i is the logprob of the token at i + 1.
    """
    b, t, v = logits_1TV.shape
    dtype = torch.promote_types(logits_1TV.dtype, torch.float32)
    temp_T = per_position_temperature(temperature, b * t, dtype, logits_1TV.device)
    logp_T = _TokenLogprobs.apply(  # type: ignore[no-untyped-call]
        logits_1TV.reshape(b * t, v), targets_1T.reshape(b * t), temp_T, chunk
    )
    assert isinstance(logp_T, torch.Tensor)
    return logp_T.reshape(b, t)


class _TokenEntropy(torch.autograd.Function):
    """Entropy of softmax(logits / T) per position, chunked like `_TokenLogprobs`: forward keeps
    the [T] entropies, backward recomputes each chunk's softmax. With z = logits / T and
    p = softmax(z): dH/dz_j = -p_j (log p_j + H), and dH/dlogits = dH/dz / T."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        logits_TV: torch.Tensor,
        temp_T: torch.Tensor,
        chunk: int,
    ) -> torch.Tensor:
        dtype = temp_T.dtype
        h_T = torch.empty(logits_TV.shape[0], dtype=dtype, device=logits_TV.device)
        for s in range(0, logits_TV.shape[0], chunk):
            logp = torch.log_softmax(
                logits_TV[s : s + chunk].to(dtype) / temp_T[s : s + chunk, None], dim=-1
            )
            h_T[s : s + chunk] = -(logp.exp() * logp).sum(-1)
        ctx.save_for_backward(logits_TV, temp_T, h_T)
        ctx.chunk = chunk  # type: ignore[attr-defined]
        return h_T

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_T: torch.Tensor
    ) -> tuple[torch.Tensor, None, None]:
        logits_TV, temp_T, h_T = ctx.saved_tensors  # type: ignore[attr-defined]
        chunk: int = ctx.chunk  # type: ignore[attr-defined]
        grad_TV = torch.empty_like(logits_TV)
        for s in range(0, logits_TV.shape[0], chunk):
            t_T1 = temp_T[s : s + chunk, None]
            logp = torch.log_softmax(logits_TV[s : s + chunk].to(h_T.dtype) / t_T1, dim=-1)
            g_T1 = grad_T[s : s + chunk].to(h_T.dtype)[:, None]
            dz = -logp.exp() * (logp + h_T[s : s + chunk, None])
            grad_TV[s : s + chunk] = g_T1 * dz / t_T1
        return grad_TV, None, None


def token_entropy(
    logits_1TV: torch.Tensor, temperature: float | torch.Tensor = 1.0, chunk: int = 1024
) -> torch.Tensor:
    """Entropy of the sampling distribution `softmax(logits / temperature)` at every position,
    [1, T], in float32 (float64 for float64 logits); differentiable and memory-light like
    `token_logprobs`. Position i is the distribution the token at i + 1 was drawn from."""
    b, t, v = logits_1TV.shape
    dtype = torch.promote_types(logits_1TV.dtype, torch.float32)
    temp_T = per_position_temperature(temperature, b * t, dtype, logits_1TV.device)
    h_T = _TokenEntropy.apply(logits_1TV.reshape(b * t, v), temp_T, chunk)  # type: ignore[no-untyped-call]
    assert isinstance(h_T, torch.Tensor)
    return h_T.reshape(b, t)
