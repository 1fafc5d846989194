"""Advantages: group baselines, batch normalisation, per-turn broadcast, GAE and REINFORCE++.

Legend: N = trajectories, G = groups, B = sequences in a batch, T = token positions, K = turns of
one segment.

Token alignment. Every `_BT` (or `_T`) tensor is indexed by token position: `x_BT[b, t]` belongs to
token `t` of row `b`, the way the store's arrays are (`logprobs[t]` is the behaviour logprob of
token `t`, computed from the logits at position `t - 1`). `mask_BT` is the store's `loss_mask`:
1 on sampled tokens, 0 on prompt, tool and padding tokens. AReaL keeps tensors aligned to the
position whose logits predict the next token and rolls the loss mask by -1 instead (as do the
packed micro-batches of `trainer.batch`); the two are the same computation shifted by one place,
and every function here only needs its arguments to share one alignment.

All functions treat their inputs as constants (advantages carry no gradient); none keeps state.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trainer.algorithms.kinds import GroupMode


def group_index(group_ids: Sequence[str | None]) -> tuple[torch.Tensor, int]:
    """Dense group number per row (in order of first appearance) and the number of groups G.

    Rows are grouped by equal id, wherever they sit; each None is a group of its own.
    """
    seen: dict[str, int] = {}
    index: list[int] = []
    n_groups = 0
    for gid in group_ids:
        if gid is None or gid not in seen:
            if gid is not None:
                seen[gid] = n_groups
            index.append(n_groups)
            n_groups += 1
        else:
            index.append(seen[gid])
    return torch.tensor(index, dtype=torch.long), n_groups


def group_baseline(
    reward_N: torch.Tensor,
    group_ids: Sequence[str | None],
    mode: GroupMode,
    eps: float = 1e-5,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(baseline_N, scale_N): each trajectory's advantage is `(x - baseline) * scale`, for its
    episode reward x = r and for any per-turn return of it (the trainer's use).

    - "mean" (Dr.GRPO): baseline `mean_g`, scale 1.
    - "mean_std" (GRPO): baseline `mean_g`, scale `1 / (std_g + eps)`, with the unbiased std
      `sqrt(sum (r - mean_g)^2 / (n_g - 1))` (AReaL's `std_unbiased=True` default).
    - "leave_one_out" (RLOO): baseline `(S_g - r) / (n_g - 1)`, the mean of the other members;
      scale 1.
    - "none": baseline 0, scale 1.

    A group of one (every None id is one) has baseline r and scale 1 in every baselined mode: its
    episode advantage is 0, it has nothing to be compared with. (AReaL agrees for "mean" and
    "mean_std"; for leave-one-out it uses a baseline of 0, i.e. the raw reward, which would let a
    lone trajectory's reward offset outweigh every real group. Ungrouped data belongs with mode
    "none" and batch normalisation.)
    """
    if reward_N.ndim != 1 or reward_N.shape[0] != len(group_ids):
        raise ValueError(
            f"reward_N has shape {tuple(reward_N.shape)} but there are {len(group_ids)} group "
            "ids: pass one reward and one group id per trajectory"
        )
    if eps <= 0:
        raise ValueError(f"eps must be > 0 (a uniform group has std 0), got {eps}")
    r_N = reward_N.detach()
    ones_N = torch.ones_like(r_N)
    if mode == "none":
        return torch.zeros_like(r_N), ones_N
    if mode not in ("mean", "mean_std", "leave_one_out"):
        raise ValueError(f"unknown group mode {mode!r}: use mean, mean_std, leave_one_out or none")
    g_N, n_groups = group_index(group_ids)
    g_N = g_N.to(r_N.device)
    count_G = torch.zeros(n_groups, dtype=r_N.dtype, device=r_N.device)
    count_G.index_add_(0, g_N, ones_N)
    sum_G = torch.zeros_like(count_G).index_add_(0, g_N, r_N)
    count_N, sum_N = count_G[g_N], sum_G[g_N]
    alone_N = count_N < 2
    if mode == "leave_one_out":
        baseline_N = (sum_N - r_N) / (count_N - 1).clamp(min=1)
        return torch.where(alone_N, r_N, baseline_N), ones_N
    mean_N = sum_N / count_N
    if mode == "mean":
        return mean_N, ones_N
    sq_G = torch.zeros_like(count_G).index_add_(0, g_N, (r_N - mean_N).square())
    std_N = (sq_G[g_N] / (count_N - 1).clamp(min=1)).sqrt()
    return mean_N, torch.where(alone_N, ones_N, 1.0 / (std_N + eps))


def group_advantages(
    reward_N: torch.Tensor,
    group_ids: Sequence[str | None],
    mode: GroupMode,
    eps: float = 1e-5,
) -> torch.Tensor:
    """Per-trajectory advantage against its group's baseline: `(r - baseline) * scale` of
    `group_baseline` (see there for the modes; a group of one gets 0 in every baselined mode)."""
    baseline_N, scale_N = group_baseline(reward_N, group_ids, mode, eps)
    return (reward_N.detach() - baseline_N) * scale_N


def turn_group_advantages(
    return_R: torch.Tensor,
    group_ids: Sequence[str | None],
    positions: Sequence[int],
    mode: GroupMode,
    eps: float = 1e-5,
) -> torch.Tensor:
    """Multi-turn credit: each turn's discounted return against the same turn position of its
    group. R = every turn of every trajectory (row r is turn `positions[r]` of a trajectory of
    group `group_ids[r]`); the group statistics of `group_baseline` are taken over the rows of
    one group at one position, so every return is compared with returns of the same kind: the
    same number of turns into the episode, with the same number of future rewards.

    Properties (each tested against a float64 loop): a single-turn group is GRPO/RLOO/Dr.GRPO
    on the episode; with one final reward and gamma 1 every position of a group sees the
    episode rewards of the members that reached it; a uniform group (every member's return the
    same at a position) gets 0 there, never `1 / eps`; with mean_std every advantage is a
    z-score within its position's group, so no turn of any group outweighs another's scale. A
    position only one member of its group reached has nothing to be compared with: 0 (in every
    baselined mode). A None group id is a group of its own per trajectory: pass a unique id per
    trajectory instead of None (rows of one None would not find each other)."""
    if return_R.ndim != 1 or not return_R.shape[0] == len(group_ids) == len(positions):
        raise ValueError(
            f"return_R has shape {tuple(return_R.shape)}, with {len(group_ids)} group ids and "
            f"{len(positions)} positions: pass one of each per turn"
        )
    keys = [None if g is None else f"{g}\x00{p}" for g, p in zip(group_ids, positions, strict=True)]
    return group_advantages(return_R, keys, mode, eps)


def reward_to_go(
    reward_T: torch.Tensor, mask_T: torch.Tensor, gamma: float | torch.Tensor
) -> torch.Tensor:
    """Per sampled token, the discounted sum of the token rewards from it to the segment's end,
    over sampled tokens only (`discounted_returns` of one row): how a per-token reward (the KL
    penalty in the reward) reaches the advantages without a critic. 0 off the mask. `gamma` is
    one factor or one per token (`gae`)."""
    g = gamma[None] if isinstance(gamma, torch.Tensor) else gamma
    return discounted_returns(reward_T[None], mask_T[None], g)[0]


def normalize(x_BT: torch.Tensor, mask_BT: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """`(x - mean) / (std + eps)` with mean and unbiased std over the masked entries; 0 elsewhere.

    The statistics cover the whole tensor given (normalise the full batch before splitting it into
    micro-batches). With fewer than two masked entries the std is taken as 0.
    """
    if eps <= 0:
        raise ValueError(f"eps must be > 0 (uniform values have std 0), got {eps}")
    x = x_BT.detach()
    m = mask_BT.to(x.dtype)
    n = m.sum()
    mean = (x * m).sum() / n.clamp(min=1)
    var = ((x - mean) * m).square().sum() / (n - 1).clamp(min=1)
    return (x - mean) * m / (var.sqrt() + eps)


def _check_spans(spans: Sequence[tuple[int, int]], length: int) -> None:
    prev_end = 0
    for start, end in spans:
        if not prev_end <= start <= end <= length:
            raise ValueError(
                f"turn span [{start}, {end}) is not an ordered, non-overlapping span inside a "
                f"segment of {length} tokens: pass the segment's own turn_spans"
            )
        prev_end = end


def turn_values_to_tokens(
    value_K: torch.Tensor, spans: Sequence[tuple[int, int]], length: int
) -> torch.Tensor:
    """Broadcast one scalar per turn (a return or an advantage) over that turn's sampled tokens.

    `spans` are the segment's `turn_spans` (half-open [start, end) per completion, in turn order);
    the result has `length` entries and is 0 outside the spans.
    """
    if value_K.ndim != 1 or value_K.shape[0] != len(spans):
        raise ValueError(f"{len(spans)} turn spans need {len(spans)} values, got {value_K.shape}")
    _check_spans(spans, length)
    out_T = torch.zeros(length, dtype=value_K.dtype, device=value_K.device)
    for k, (start, end) in enumerate(spans):
        out_T[start:end] = value_K[k]
    return out_T


def rewards_at_turn_ends(
    reward_K: torch.Tensor, spans: Sequence[tuple[int, int]], length: int, discount: float = 1.0
) -> torch.Tensor:
    """Token rewards for GAE: each turn's reward on the last sampled token of that turn.

    A turn with no sampled tokens has nowhere to put its reward; it is added to the last sampled
    token before it, discounted once per turn between them (`discount ** (k - k')`, so the
    returns there are what the per-turn discount makes them), or dropped if there is none.
    """
    if reward_K.ndim != 1 or reward_K.shape[0] != len(spans):
        raise ValueError(f"{len(spans)} turn spans need {len(spans)} rewards, got {reward_K.shape}")
    _check_spans(spans, length)
    out_T = torch.zeros(length, dtype=reward_K.dtype, device=reward_K.device)
    last, last_k = -1, -1
    for k, (start, end) in enumerate(spans):
        if end > start:
            last, last_k = end - 1, k
        if last >= 0:
            out_T[last] += reward_K[k] * discount ** (k - last_k)
    return out_T


def turn_discounts(spans: Sequence[tuple[int, int]], length: int, discount: float) -> torch.Tensor:
    """The per-token discount of `gae` for one segment under a per-turn `discount`: at each
    sampled token, the factor to the next sampled token of the row, 1 inside a turn and
    `discount ** d` from a turn's last sampled token to the next turn that has one, d turns
    later (a turn without sampled tokens still counts). float64, 1 off the spans."""
    _check_spans(spans, length)
    out_T = torch.ones(length, dtype=torch.float64)
    prev_end, prev_k = -1, -1
    for k, (start, end) in enumerate(spans):
        if end > start:
            if prev_end >= 0:
                out_T[prev_end] = discount ** (k - prev_k)
            prev_end, prev_k = end - 1, k
    return out_T


def gae(
    rewards_BT: torch.Tensor,
    values_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    gamma: float | torch.Tensor,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the sampled tokens of each row.

    Walking each row backwards over its sampled tokens only (AReaL skips masked positions: neither
    the discount nor the value chain advances across prompt or tool tokens):
    `delta_t = r_t + g_t * V_next - V_t`, `A_t = delta_t + g_t * lam * A_next`, where `next` is
    the next sampled token of the row, and after the last sampled token `V_next = A_next = 0` (the
    episode ends; no bootstrap). `returns = A + V`. Both outputs are 0 at masked positions.
    `gamma` is one discount g for every step, or `[B, T]` of them: g_t the factor from token t
    to the next sampled token (`turn_discounts`: a per-turn discount, 1 inside a turn).

    `values_BT[b, t]` is the critic's value of the state before token t is sampled (computed at
    position t - 1, aligned like logprobs); rewards sit on sampled tokens (`rewards_at_turn_ends`),
    plus any per-token KL penalty. With V = 0 and lam = 1, A_t is the discounted reward-to-go.
    Each row must be one sequence: on a packed row the chain would run across sequences.
    """
    if not rewards_BT.shape == values_BT.shape == mask_BT.shape or rewards_BT.ndim != 2:
        raise ValueError(
            "rewards_BT, values_BT and mask_BT must share one [B, T] shape, got "
            f"{tuple(rewards_BT.shape)}, {tuple(values_BT.shape)}, {tuple(mask_BT.shape)}"
        )
    r, v = rewards_BT.detach(), values_BT.detach()
    m = mask_BT.bool()
    if isinstance(gamma, torch.Tensor) and gamma.shape != rewards_BT.shape:
        raise ValueError(f"gamma has shape {tuple(gamma.shape)}; rewards {tuple(r.shape)}")
    g_BT = gamma.to(r.dtype) if isinstance(gamma, torch.Tensor) else torch.full_like(r, gamma)
    adv_BT = torch.zeros_like(r)
    next_value_B = torch.zeros_like(r[:, 0])
    next_adv_B = torch.zeros_like(r[:, 0])
    for t in reversed(range(r.shape[1])):
        delta_B = r[:, t] + g_BT[:, t] * next_value_B - v[:, t]
        adv_B = delta_B + g_BT[:, t] * lam * next_adv_B
        m_B = m[:, t]
        next_adv_B = torch.where(m_B, adv_B, next_adv_B)
        next_value_B = torch.where(m_B, v[:, t], next_value_B)
        adv_BT[:, t] = torch.where(m_B, adv_B, torch.zeros_like(adv_B))
    returns_BT = torch.where(m, adv_BT + v, torch.zeros_like(v))
    return adv_BT, returns_BT


def discounted_returns(
    rewards_BT: torch.Tensor, mask_BT: torch.Tensor, gamma: float | torch.Tensor
) -> torch.Tensor:
    """Reward-to-go over each row's sampled tokens: GAE with V = 0 and lam = 1 (AReaL without a
    critic). With one final reward and gamma = 1 every sampled token gets that reward."""
    return gae(rewards_BT, torch.zeros_like(rewards_BT), mask_BT, gamma, 1.0)[0]


def reinforce_pp_advantages(
    return_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    baseline_BT: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """REINFORCE++: `normalize(return - baseline)` over the whole batch's sampled tokens.

    AReaL's REINFORCE++ has no group baseline (reward_norm none), a KL penalty folded into the
    token rewards (k1, 0.001) and batch advantage normalisation; `return_BT` is
    `discounted_returns` of those token rewards. `baseline_BT` (e.g. a group mean broadcast over
    tokens) gives the "REINFORCE baseline" variant.
    """
    x = return_BT if baseline_BT is None else return_BT - baseline_BT
    return normalize(x, mask_BT, eps)
