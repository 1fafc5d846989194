"""From reward-labelled trajectories (the store's) to training sequences with token advantages.

Order of operations (AReaL's): DAPO overlong shaping of the episode rewards, dynamic sampling
(drop groups whose rewards are all equal), the group baseline, then per-turn values broadcast over
each turn's sampled tokens (`build_sequences`); then the per-token KL to the reference subtracted
from the token rewards as a reward-to-go (`kl_token_rewards`), and batch normalisation over all
sampled tokens (`with_advantages`; with a critic, `with_gae` runs GAE over the token rewards,
KL included, and normalises).

The sampling contract (`store.run_config`): each token is trained at the temperature its turn was
sampled at (`TrainSequence.temperatures`); a turn whose distribution the trainer cannot reproduce
(greedy, top-p, top-k, min-p, min_tokens) keeps its tokens as context with loss mask 0 and is
counted in `Built.untrainable_turns`.

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
from dataclasses import dataclass

import torch

from store.run_config import reproducible_temperature
from store.types import Segment, Trajectory
from trainer.algorithms.advantages import (
    gae,
    group_baseline,
    normalize,
    reward_to_go,
    rewards_at_turn_ends,
    turn_values_to_tokens,
)
from trainer.algorithms.config import AlgorithmConfig
from trainer.algorithms.losses import kl_penalty
from trainer.algorithms.shaping import drop_uniform_groups, overlong_shaping
from trainer.batch import TrainSequence


@dataclass(frozen=True, slots=True)
class Built:
    sequences: list[TrainSequence]
    """Without a critic each sequence's `advantages` are its turns' values against the group
    baseline, not yet KL-shaped nor normalised (`with_advantages` finishes them); with a critic
    they are 0 until `with_gae`."""
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
    untrainable_turns: int = 0
    """Turns sampled under a distribution the trainer cannot reproduce (module docstring): kept
    as context, left out of the loss."""


def _group_key(t: Trajectory) -> str:
    return t.session.group_id if t.session.group_id is not None else f"solo:{t.session.id}"


@dataclass(frozen=True, slots=True)
class _Tokens:
    """One segment as the trainer takes it: loss mask without its untrainable turns, and each
    token's temperature."""

    loss_mask: list[int]
    temperatures: list[float]
    untrainable: int
    spans: list[tuple[int, int]]
    """The turn spans, an untrainable turn's made empty (its reward then goes to the trained
    token before it, `rewards_at_turn_ends`)."""


def _segment_tokens(seg: Segment, default_temperature: float) -> _Tokens:
    mask = list(seg.loss_mask)
    temps = [default_temperature] * len(seg.tokens)
    untrainable = 0
    spans: list[tuple[int, int]] = []
    sampling = seg.turn_sampling or [{}] * len(seg.turn_spans)
    for (start, end), settings in zip(seg.turn_spans, sampling, strict=True):
        t = reproducible_temperature(settings, default_temperature)
        if t is None:
            untrainable += 1
            mask[start:end] = [0] * (end - start)
            spans.append((start, start))
        else:
            temps[start:end] = [t] * (end - start)
            spans.append((start, end))
    return _Tokens(mask, temps, untrainable, spans)


def build_sequences(
    trajectories: list[Trajectory],
    algo: AlgorithmConfig,
    *,
    max_tokens: int | None = None,
    discount: float = 1.0,
    temperature: float = 1.0,
) -> Built:
    """Sequences with their turns' values against the group baseline (module docstring; finish
    them with `with_advantages`). With a critic (`use_critic`) the advantages are left at 0 and
    `Built.token_rewards` is filled instead: GAE needs the critic's values first (`with_gae`).
    `discount` is the per-turn gamma the store's returns were discounted with (the run config's
    `discount`); `temperature` is the run's, for turns that record none."""
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

    if algo.use_critic:  # the critic's values are the baseline
        base = [(0.0, 1.0)] * len(kept)
    else:
        episode = [
            (
                trajectories[i].returns[_first_turn(trajectories[i])]
                if trajectories[i].returns
                else 0.0
            )
            + shift[i]
            for i in kept
        ]
        baseline_N, scale_N = group_baseline(
            torch.tensor(episode, dtype=torch.float64),
            [keys[i] for i in kept],
            algo.group_baseline,
            algo.norm_eps,
        )
        base = list(zip(baseline_N.tolist(), scale_N.tolist(), strict=True))

    sequences: list[TrainSequence] = []
    token_rewards: list[list[float]] = []
    used: list[Trajectory] = []
    used_rewards: list[float] = []
    untrainable = 0
    for (b, scale), i in zip(base, kept, strict=True):
        t = trajectories[i]
        produced = False
        for seg in t.segments:
            if not any(seg.loss_mask):
                continue
            toks = _segment_tokens(seg, temperature)
            untrainable += toks.untrainable
            if not any(toks.loss_mask):
                continue
            returns = [t.returns.get(cid, 0.0) + shift[i] for cid in seg.completion_ids]
            if algo.use_critic:
                r_T = critic_token_rewards(returns, toks.spans, len(seg.tokens), discount)
                token_rewards.append(r_T.tolist())
                adv = [0.0] * len(seg.tokens)
            else:
                values = torch.tensor([(g - b) * scale for g in returns], dtype=torch.float64)
                adv_T = turn_values_to_tokens(values, seg.turn_spans, len(seg.tokens))
                adv = [v if m else 0.0 for v, m in zip(adv_T.tolist(), toks.loss_mask, strict=True)]
            sequences.append(
                TrainSequence(
                    tokens=list(seg.tokens),
                    loss_mask=toks.loss_mask,
                    behav_logprobs=[
                        lp if m else 0.0 for lp, m in zip(seg.logprobs, toks.loss_mask, strict=True)
                    ],
                    advantages=adv,
                    versions=[
                        v if m else -1 for v, m in zip(seg.versions, toks.loss_mask, strict=True)
                    ],
                    temperatures=toks.temperatures,
                )
            )
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
        token_rewards if algo.use_critic else None,
        aborted_turns=sum(t.aborted_turns for t in trajectories),
        untrainable_turns=untrainable,
    )


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


def kl_token_rewards(
    seqs: list[TrainSequence], ref_logprobs: list[list[float]], algo: AlgorithmConfig
) -> tuple[list[list[float]], float]:
    """The KL penalty as token rewards (AReaL's KL-in-reward): `-kl_coef * KL_est(behav - ref)`
    per sampled token (clamped, `kl_penalty`), 0 elsewhere, the behaviour policy being the one
    that sampled the token; and the mean KL estimate over sampled tokens (the metric `kl_ref`)."""
    out: list[list[float]] = []
    total, count = 0.0, 0
    for s, ref in zip(seqs, ref_logprobs, strict=True):
        behav = torch.tensor(s.behav_logprobs, dtype=torch.float64)
        kl_T = kl_penalty(behav, torch.tensor(ref, dtype=torch.float64), algo.kl_kind)
        mask_T = torch.tensor(s.loss_mask, dtype=torch.bool)
        kl_T = torch.where(mask_T, kl_T, torch.zeros_like(kl_T))
        total += float(kl_T.sum())
        count += int(mask_T.sum())
        out.append((-algo.kl_coef * kl_T).tolist())
    return out, total / max(count, 1)


def with_advantages(
    seqs: list[TrainSequence],
    algo: AlgorithmConfig,
    kl_rewards: list[list[float]] | None = None,
) -> list[TrainSequence]:
    """Final token advantages without a critic: each sequence's turn values (`build_sequences`)
    plus the reward-to-go of its KL token rewards, if any (gamma = `algo.gamma` per sampled token;
    AReaL's GAE with V = 0 and lambda = 1), then batch normalisation when `adv_norm` is batch."""
    if not seqs:
        return []
    advs: list[torch.Tensor] = []
    for k, s in enumerate(seqs):
        adv_T = torch.tensor(s.advantages, dtype=torch.float64)
        mask_T = torch.tensor(s.loss_mask, dtype=torch.bool)
        if kl_rewards is not None:
            kl_T = torch.tensor(kl_rewards[k], dtype=torch.float64)
            adv_T = adv_T + reward_to_go(kl_T, mask_T, algo.gamma)
        advs.append(torch.where(mask_T, adv_T, torch.zeros_like(adv_T)))
    if algo.adv_norm == "batch":
        flat = torch.cat(advs)[None]
        mask = torch.cat([torch.tensor(s.loss_mask, dtype=torch.bool) for s in seqs])[None]
        advs = list(torch.split(normalize(flat, mask, algo.norm_eps)[0], [len(s) for s in seqs]))
    return [
        dataclasses.replace(
            s,
            advantages=[
                float(v) if m else 0.0 for v, m in zip(a.tolist(), s.loss_mask, strict=True)
            ],
        )
        for s, a in zip(seqs, advs, strict=True)
    ]


def with_gae(
    seqs: list[TrainSequence],
    token_rewards: list[list[float]],
    values: list[list[float]],
    algo: AlgorithmConfig,
    kl_rewards: list[list[float]] | None = None,
) -> list[TrainSequence]:
    """The sequences with GAE advantages (batch-normalised when `adv_norm` is batch), the critic's
    old `values` and the `returns` it regresses on, all 0 off the loss mask. `kl_rewards` (the KL
    penalty in the reward, `kl_token_rewards`) are added to the token rewards first.

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
        if kl_rewards is not None:
            r_BT[b, :n] += torch.tensor(kl_rewards[b], dtype=torch.float64)
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
