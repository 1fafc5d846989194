"""From reward-labelled trajectories (the store's) to training sequences with token advantages.

Order of operations (AReaL's): DAPO overlong shaping of the episode rewards, dynamic sampling
(drop groups whose rewards are all equal), the group baseline, then per-turn values broadcast over
each turn's sampled tokens, then batch normalisation over all sampled tokens.

Per-turn advantages: turn i of trajectory n has the discounted return G_ni (the store's
`returns`). The group baseline is taken over the episode returns G_n0 of the group, and the turn's
advantage is `(G_ni - b_g) / s_g`, where s_g is the group std for mean_std and 1 otherwise: for a
single turn, or a final reward with gamma 1, this is exactly GRPO/RLOO/Dr.GRPO on the episode.

With a critic (PPO) the critic's values replace the group baseline: each turn's reward goes on its
last sampled token (`critic_token_rewards`), the loop asks the critic for its values of the batch,
and `with_gae` turns rewards and values into GAE advantages (batch-normalised as above) and the
returns the critic regresses on.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from dataclasses import dataclass

import torch

from store.types import Trajectory
from trainer.algorithms.advantages import (
    gae,
    normalize,
    rewards_at_turn_ends,
    turn_values_to_tokens,
)
from trainer.algorithms.config import AlgorithmConfig
from trainer.algorithms.shaping import drop_uniform_groups, overlong_shaping
from trainer.batch import TrainSequence


@dataclass(frozen=True, slots=True)
class Built:
    sequences: list[TrainSequence]
    used: list[Trajectory]
    """Trajectories that contributed sequences (trained)."""
    dropped: list[Trajectory]
    """Trajectories left out on purpose (dynamic sampling, no sampled tokens)."""
    rewards: list[float]
    """Episode rewards of `used`, after shaping."""
    token_rewards: list[list[float]] | None = None
    """With a critic: per sequence, each turn's reward on the turn's last sampled token (GAE's
    input, see `critic_token_rewards`); the sequences' advantages are then 0 until `with_gae`."""
    aborted_turns: int = 0
    """Aborted turns of the given trajectories, left out by the store (replies their agent never
    saw whole are never trained): the step's count of them."""


def _group_key(t: Trajectory) -> str:
    return t.session.group_id if t.session.group_id is not None else f"solo:{t.session.id}"


def _baselines(
    episode: list[float], keys: list[str], mode: str, eps: float
) -> list[tuple[float, float]]:
    """(baseline, scale) per trajectory for its group."""
    members: dict[str, list[int]] = defaultdict(list)
    for i, k in enumerate(keys):
        members[k].append(i)
    out: list[tuple[float, float]] = []
    for i, k in enumerate(keys):
        group = members[k]
        n = len(group)
        if mode == "none":
            out.append((0.0, 1.0))
            continue
        if n == 1:  # nothing to compare with: advantage 0
            out.append((episode[i], 1.0))
            continue
        total = sum(episode[j] for j in group)
        if mode == "leave_one_out":
            out.append(((total - episode[i]) / (n - 1), 1.0))
            continue
        mean = total / n
        if mode == "mean":
            out.append((mean, 1.0))
            continue
        std = math.sqrt(sum((episode[j] - mean) ** 2 for j in group) / (n - 1))
        out.append((mean, 1.0 / (std + eps)))
    return out


def build_sequences(
    trajectories: list[Trajectory],
    algo: AlgorithmConfig,
    *,
    max_tokens: int | None = None,
    discount: float = 1.0,
) -> Built:
    """Sequences with token advantages (module docstring). With a critic (`use_critic`) the
    advantages are left at 0 and `Built.token_rewards` is filled instead: GAE needs the critic's
    values first (`with_gae`). `discount` is the per-turn gamma the store's returns were
    discounted with (the run config's `discount`)."""
    keys = [_group_key(t) for t in trajectories]
    rewards = [t.reward for t in trajectories]
    if algo.overlong_buffer is not None and max_tokens is not None:
        lengths = [
            max((b - a for s in t.segments for a, b in s.turn_spans), default=0)
            for t in trajectories
        ]
        shaped = overlong_shaping(
            torch.tensor(rewards, dtype=torch.float64),
            torch.tensor(lengths, dtype=torch.float64),
            max_len=max_tokens,
            overlong_buffer=algo.overlong_buffer,
            penalty_factor=algo.overlong_penalty_factor,
        )
        rewards = shaped.tolist()
    keep = [True] * len(trajectories)
    if algo.dynamic_sampling and trajectories:
        keep = drop_uniform_groups(torch.tensor(rewards, dtype=torch.float64), keys).tolist()
    kept = [i for i in range(len(trajectories)) if keep[i]]
    dropped = [trajectories[i] for i in range(len(trajectories)) if not keep[i]]
    shift = [r - trajectories[i].reward for i, r in enumerate(rewards)]

    if algo.use_critic:
        return _critic_sequences(trajectories, kept, dropped, rewards, shift, discount)
    episode = [
        (trajectories[i].returns[_first_turn(trajectories[i])] if trajectories[i].returns else 0.0)
        + shift[i]
        for i in kept
    ]
    base = _baselines(episode, [keys[i] for i in kept], algo.group_baseline, algo.norm_eps)

    raw: list[tuple[TrainSequence, torch.Tensor]] = []
    used: list[Trajectory] = []
    used_rewards: list[float] = []
    for (b, scale), i in zip(base, kept, strict=True):
        t = trajectories[i]
        produced = False
        for seg in t.segments:
            if not any(seg.loss_mask):
                continue
            values = [
                ((t.returns.get(cid, 0.0) + shift[i]) - b) * scale for cid in seg.completion_ids
            ]
            adv_T = turn_values_to_tokens(
                torch.tensor(values, dtype=torch.float64), seg.turn_spans, len(seg.tokens)
            )
            mask_T = torch.tensor(seg.loss_mask, dtype=torch.bool)
            seq = TrainSequence(
                tokens=list(seg.tokens),
                loss_mask=list(seg.loss_mask),
                behav_logprobs=list(seg.logprobs),
                advantages=[0.0] * len(seg.tokens),
                versions=list(seg.versions),
            )
            raw.append((seq, torch.where(mask_T, adv_T, torch.zeros_like(adv_T))))
            produced = True
        if produced:
            used.append(t)
            used_rewards.append(rewards[i])
        else:
            dropped.append(t)
    if algo.adv_norm == "batch" and raw:
        flat = torch.cat([a for _, a in raw])[None]
        mask = torch.cat([torch.tensor(s.loss_mask, dtype=torch.bool) for s, _ in raw])[None]
        normed = normalize(flat, mask, algo.norm_eps)[0]
        parts = torch.split(normed, [len(s.tokens) for s, _ in raw])
        raw = [(s, p) for (s, _), p in zip(raw, parts, strict=True)]
    sequences = [_with_advantages(s, a) for s, a in raw]
    return Built(sequences, used, dropped, used_rewards, aborted_turns=_aborted_turns(trajectories))


def critic_token_rewards(
    returns: list[float], spans: list[tuple[int, int]], length: int, discount: float
) -> torch.Tensor:
    """Token rewards of one segment for GAE, from its turns' discounted returns G_1..G_k.

    Turn j's own reward `G_j - discount * G_{j+1}` sits on its last sampled token, and the last
    turn gets its whole return G_k, which is its own reward plus the discounted return of every
    later turn of the trajectory (later segments): the segment's tail is the Monte Carlo return
    rather than a bootstrap, and with one final reward and gamma = 1 each turn's token reward is
    0 but the last one, which is that reward.
    """
    g = [*returns, 0.0]
    own = [g[j] - discount * g[j + 1] for j in range(len(returns) - 1)]
    per_turn = [*own, g[len(returns) - 1]] if returns else []
    return rewards_at_turn_ends(torch.tensor(per_turn, dtype=torch.float64), spans, length)


def _critic_sequences(
    trajectories: list[Trajectory],
    kept: list[int],
    dropped: list[Trajectory],
    rewards: list[float],
    shift: list[float],
    discount: float,
) -> Built:
    """With a critic the values are the baseline: no group baseline, token rewards instead."""
    sequences: list[TrainSequence] = []
    token_rewards: list[list[float]] = []
    used: list[Trajectory] = []
    used_rewards: list[float] = []
    for i in kept:
        t = trajectories[i]
        produced = False
        for seg in t.segments:
            if not any(seg.loss_mask):
                continue
            returns = [t.returns.get(cid, 0.0) + shift[i] for cid in seg.completion_ids]
            r_T = critic_token_rewards(returns, seg.turn_spans, len(seg.tokens), discount)
            sequences.append(
                TrainSequence(
                    tokens=list(seg.tokens),
                    loss_mask=list(seg.loss_mask),
                    behav_logprobs=list(seg.logprobs),
                    advantages=[0.0] * len(seg.tokens),
                    versions=list(seg.versions),
                )
            )
            token_rewards.append(r_T.tolist())
            produced = True
        if produced:
            used.append(t)
            used_rewards.append(rewards[i])
        else:
            dropped.append(t)
    return Built(
        sequences,
        used,
        dropped,
        used_rewards,
        token_rewards,
        aborted_turns=_aborted_turns(trajectories),
    )


def _aborted_turns(trajectories: list[Trajectory]) -> int:
    return sum(t.aborted_turns for t in trajectories)


def with_gae(
    seqs: list[TrainSequence],
    token_rewards: list[list[float]],
    values: list[list[float]],
    algo: AlgorithmConfig,
) -> list[TrainSequence]:
    """The sequences with GAE advantages (batch-normalised when `adv_norm` is batch), the critic's
    old `values` and the `returns` it regresses on, all 0 off the loss mask.

    `values[i][t]` is the critic's value of the state before token t (`forward_values`). GAE runs
    over each sequence's sampled tokens only (`trainer.algorithms.gae`, gamma = `algo.gamma`,
    lambda = `algo.lam`), in float64; padding the batch to one width changes nothing because
    padded positions are masked.
    """
    if not seqs:
        return []
    width = max(len(s) for s in seqs)
    r_BT = torch.zeros(len(seqs), width, dtype=torch.float64)
    v_BT = torch.zeros_like(r_BT)
    m_BT = torch.zeros(len(seqs), width, dtype=torch.bool)
    for b, (s, r, v) in enumerate(zip(seqs, token_rewards, values, strict=True)):
        n = len(s)
        r_BT[b, :n] = torch.tensor(r, dtype=torch.float64)
        v_BT[b, :n] = torch.tensor(v, dtype=torch.float64)
        m_BT[b, :n] = torch.tensor(s.loss_mask, dtype=torch.bool)
    adv_BT, ret_BT = gae(r_BT, v_BT, m_BT, algo.gamma, algo.lam)
    if algo.adv_norm == "batch":
        adv_BT = normalize(adv_BT, m_BT, algo.norm_eps)
    v_BT = torch.where(m_BT, v_BT, torch.zeros_like(v_BT))
    out = []
    for b, s in enumerate(seqs):
        n = len(s)
        out.append(
            dataclasses.replace(
                s,
                advantages=adv_BT[b, :n].tolist(),
                values=v_BT[b, :n].tolist(),
                returns=ret_BT[b, :n].tolist(),
            )
        )
    return out


def _first_turn(t: Trajectory) -> str:
    return next(iter(t.returns))


def _with_advantages(seq: TrainSequence, adv_T: torch.Tensor) -> TrainSequence:
    values = [float(v) if m else 0.0 for v, m in zip(adv_T.tolist(), seq.loss_mask, strict=True)]
    return TrainSequence(
        tokens=seq.tokens,
        loss_mask=seq.loss_mask,
        behav_logprobs=seq.behav_logprobs,
        advantages=values,
        versions=seq.versions,
    )
