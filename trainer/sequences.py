"""From reward-labelled trajectories (the store's) to training sequences with token advantages.

Order of operations (AReaL's): no task reward for a turn `max_tokens` cut when
`zero_truncated_reward` is on (its turn rewards zeroed, the returns taken again; AReaL's
`mask_no_eos_with_zero`), DAPO overlong shaping of the episode rewards, dynamic sampling
(drop groups whose rewards are all equal), the group baseline, then per-turn values broadcast over
each turn's sampled tokens (`build_sequences`); then the per-token KL to the reference subtracted
from the token rewards as a reward-to-go (`kl_token_rewards`), and batch normalisation over all
sampled tokens (`with_advantages`; with a critic, `with_gae` runs GAE over the token rewards,
KL included, and normalises).

The sampling contract (`store.run_config`): each token is trained at the temperature its turn was
sampled at (`TrainSequence.temperatures`); a turn whose distribution the trainer cannot reproduce
(greedy, top-p, top-k, min-p, min_tokens) keeps its tokens as context with loss mask 0 and is
counted in `Built.untrainable_turns`; a turn sampled under a grammar is marked
(`TrainSequence.constrained`) for the loop to train as the contract says ("Constrained turns").

Multi-turn credit (docs/architecture.md, "Multi-turn credit"): turn i of trajectory n has the
discounted return G_ni = r_ni + discount * G_n,i+1 (the store's `returns`). Its value is
`turn_group_advantages`: G_ni against the returns of the same turn position i in its group
(mean, std, leave-one-out over the members that reached turn i). Returns are only comparable
at one position (the same number of future rewards, the same discounting ahead), so that is
where the statistics are taken; a uniform group gets 0, never 1 / eps, and a single-turn group
is exactly GRPO/RLOO/Dr.GRPO on the episode. Shaping (the overlong penalty) shifts every turn's
return of its trajectory; dynamic sampling looks at the task rewards alone.

With a critic (PPO) the critic's values replace the group baseline: each turn's reward goes on its
last sampled token (`critic_token_rewards`), the loop asks the critic for its values of the batch,
and `with_gae` turns rewards and values into GAE advantages (batch-normalised as above) and the
returns the critic regresses on.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engines.base import FinishReason
from store.run_config import constrained_turn, reproducible_temperature
from store.trajectories import discounted
from store.types import Segment, Trajectory
from trainer.algorithms.advantages import (
    gae,
    normalize,
    reward_to_go,
    rewards_at_turn_ends,
    turn_discounts,
    turn_group_advantages,
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
    filtered: list[Trajectory]
    """Left out by dynamic sampling (their group's task rewards were all equal)."""
    untrainable: list[Trajectory]
    """Nothing to train: no sampled token, or only turns the trainer cannot reproduce."""
    stale: list[Trajectory]
    """Every trainable token older than the staleness bound (`build_sequences`'s `fresh`)."""
    rewards: list[float]
    """Episode rewards of `used`, after shaping."""
    token_rewards: list[list[float]] | None = None
    """With a critic: per sequence, each turn's reward on the turn's last sampled token (GAE's
    input, see `critic_token_rewards`); the sequences' advantages are then 0 until `with_gae`."""
    discounts: list[list[float]] = dataclasses.field(default_factory=list)
    """Per sequence, `turn_discounts`: the per-turn discount as GAE and the KL reward-to-go
    apply it (1 inside a turn)."""
    aborted_turns: int = 0
    """Aborted turns of the given trajectories, left out by the store (replies their agent never
    saw whole are never trained): the step's count of them."""
    side_turns: int = 0
    """Side requests' turns of the given trajectories, left out by the store (recorded, never
    trained; `store.run_config`): the step's count of them."""
    untrainable_turns: int = 0
    """Turns sampled under a distribution the trainer cannot reproduce (module docstring): kept
    as context, left out of the loss."""
    stale_tokens: int = 0
    """Sampled tokens left out of the loss as older than the staleness bound (context only)."""
    truncated_turns: int = 0
    """Turns of the given trajectories that `max_tokens` (or the context) cut (finish reason
    `length`): rewarded as graded, or with no task reward under `zero_truncated_reward`."""

    @property
    def dropped(self) -> list[Trajectory]:
        """Every trajectory left out (filtered, untrainable, stale)."""
        return [*self.filtered, *self.untrainable, *self.stale]


def truncated_turns_unrewarded(t: Trajectory, discount: float) -> Trajectory:
    """`t` with no task reward on the turns `max_tokens` cut (`zero_truncated_reward`): their
    turn rewards (the final reward too, on a cut last turn) are 0, and the returns and the
    episode reward are taken again without them."""
    cut = [c for c, r in t.finish_reasons.items() if r == FinishReason.LENGTH and c in t.returns]
    if not cut:
        return t
    if t.turn_rewards.keys() != t.returns.keys():
        raise ValueError(
            f"session {t.session.id}: zero_truncated_reward needs the per-turn rewards of its "
            "turns, and the trajectory does not carry them"
        )
    per_turn = {c: 0.0 if c in cut else r for c, r in t.turn_rewards.items()}
    return dataclasses.replace(
        t,
        turn_rewards=per_turn,
        returns=discounted(per_turn, discount),
        reward=t.reward - math.fsum(t.turn_rewards[c] for c in cut),
    )


def _group_key(t: Trajectory) -> str:
    return t.session.group_id if t.session.group_id is not None else f"solo:{t.session.id}"


@dataclass(frozen=True, slots=True)
class _Tokens:
    """One segment as the trainer takes it: loss mask without its untrainable turns and stale
    tokens, and each token's temperature."""

    loss_mask: list[int]
    temperatures: list[float]
    constrained: list[bool] | None
    """Per token, sampled under a grammar; None when no turn was."""
    untrainable: int
    stale: int
    """Sampled tokens of reproducible turns masked as stale."""
    spans: list[tuple[int, int]]
    """The turn spans cut to their trained tokens (first to last), an untrainable or wholly
    stale turn's made empty (its reward then goes to the trained token before it,
    `rewards_at_turn_ends`)."""


def _segment_tokens(
    seg: Segment, default_temperature: float, fresh: Callable[[int], bool] | None
) -> _Tokens:
    mask = list(seg.loss_mask)
    temps = [default_temperature] * len(seg.tokens)
    constrained: list[bool] | None = None
    untrainable = stale = 0
    spans: list[tuple[int, int]] = []
    sampling = seg.turn_sampling or [{}] * len(seg.turn_spans)
    for (start, end), settings in zip(seg.turn_spans, sampling, strict=True):
        t = reproducible_temperature(settings, default_temperature)
        if t is None:
            untrainable += 1
            mask[start:end] = [0] * (end - start)
            spans.append((start, start))
            continue
        temps[start:end] = [t] * (end - start)
        if constrained_turn(settings):
            constrained = constrained or [False] * len(seg.tokens)
            constrained[start:end] = [True] * (end - start)
        if fresh is not None:
            for pos in range(start, end):
                if mask[pos] and not fresh(seg.versions[pos]):
                    mask[pos] = 0
                    stale += 1
        kept = [pos for pos in range(start, end) if mask[pos]]
        spans.append((kept[0], kept[-1] + 1) if kept else (start, start))
    return _Tokens(mask, temps, constrained, untrainable, stale, spans)


def _turn_values(
    trajectories: list[Trajectory],
    kept: list[int],
    keys: list[str],
    shift: list[float],
    algo: AlgorithmConfig,
) -> dict[tuple[int, str], float]:
    """(trajectory index, completion id) -> the turn's value: its discounted return (plus the
    trajectory's shaping shift) against its position in the group (`turn_group_advantages`),
    or the plain return with a critic (whose values are the baseline)."""
    rows = [(i, p, cid) for i in kept for p, cid in enumerate(trajectories[i].returns)]
    returns = [trajectories[i].returns[cid] + shift[i] for i, _, cid in rows]
    if algo.use_critic:
        values = returns
    else:
        values = turn_group_advantages(
            torch.tensor(returns, dtype=torch.float64),
            [keys[i] for i, _, _ in rows],
            [p for _, p, _ in rows],
            algo.group_baseline,
            algo.norm_eps,
        ).tolist()
    return {(i, cid): v for (i, _, cid), v in zip(rows, values, strict=True)}


def build_sequences(
    trajectories: list[Trajectory],
    algo: AlgorithmConfig,
    *,
    max_tokens: int | None = None,
    discount: float = 1.0,
    temperature: float = 1.0,
    fresh: Callable[[int], bool] | None = None,
) -> Built:
    """Sequences with their turns' values against the group baseline (module docstring; finish
    them with `with_advantages`). With a critic (`use_critic`) the advantages are left at 0 and
    `Built.token_rewards` is filled instead: GAE needs the critic's values first (`with_gae`).
    `discount` is the per-turn gamma the store's returns were discounted with (the run config's
    `discount`), which GAE and the KL reward-to-go then apply between turns too;
    `temperature` is the run's, for turns that record none. `fresh(version)` says whether a
    token sampled by that policy version may be trained (the staleness bound); a token it
    refuses stays context, and a trajectory left with none is `stale`."""
    truncated = sum(
        r == FinishReason.LENGTH for t in trajectories for r in t.finish_reasons.values()
    )
    if algo.zero_truncated_reward:
        trajectories = [truncated_turns_unrewarded(t, discount) for t in trajectories]
    keys = [_group_key(t) for t in trajectories]
    task = [t.reward for t in trajectories]
    rewards = list(task)
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
    if algo.dynamic_sampling and trajectories:  # on the task's rewards, not the length-shaped
        keep = drop_uniform_groups(torch.tensor(task, dtype=torch.float64), keys).tolist()
    kept = [i for i in range(len(trajectories)) if keep[i]]
    filtered = [trajectories[i] for i in range(len(trajectories)) if not keep[i]]
    shift = [r - trajectories[i].reward for i, r in enumerate(rewards)]
    values = _turn_values(trajectories, kept, keys, shift, algo)

    sequences: list[TrainSequence] = []
    token_rewards: list[list[float]] = []
    discounts: list[list[float]] = []
    used: list[Trajectory] = []
    untrainable_trajs: list[Trajectory] = []
    stale_trajs: list[Trajectory] = []
    used_rewards: list[float] = []
    untrainable = stale = 0
    for i in kept:
        t = trajectories[i]
        produced = saw_stale = False
        for seg in t.segments:
            if not any(seg.loss_mask):
                continue
            toks = _segment_tokens(seg, temperature, fresh)
            untrainable += toks.untrainable
            stale += toks.stale
            saw_stale |= toks.stale > 0
            if not any(toks.loss_mask):
                continue
            turn = [values[(i, cid)] for cid in seg.completion_ids]
            if algo.use_critic:
                r_T = critic_token_rewards(turn, toks.spans, len(seg.tokens), discount)
                token_rewards.append(r_T.tolist())
                adv = [0.0] * len(seg.tokens)
            else:
                adv_T = turn_values_to_tokens(
                    torch.tensor(turn, dtype=torch.float64), seg.turn_spans, len(seg.tokens)
                )
                adv = [v if m else 0.0 for v, m in zip(adv_T.tolist(), toks.loss_mask, strict=True)]
            discounts.append(turn_discounts(toks.spans, len(seg.tokens), discount).tolist())
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
                    constrained=toks.constrained,
                )
            )
            produced = True
        if produced:
            used.append(t)
            used_rewards.append(rewards[i])
        elif saw_stale:
            stale_trajs.append(t)
        else:
            untrainable_trajs.append(t)
    return Built(
        sequences,
        used,
        filtered,
        untrainable_trajs,
        stale_trajs,
        used_rewards,
        token_rewards if algo.use_critic else None,
        discounts,
        aborted_turns=sum(t.aborted_turns for t in trajectories),
        side_turns=sum(t.side_turns for t in trajectories),
        untrainable_turns=untrainable,
        stale_tokens=stale,
        truncated_turns=truncated,
    )


def critic_token_rewards(
    returns: list[float], spans: list[tuple[int, int]], length: int, discount: float
) -> torch.Tensor:
    """Token rewards of one segment for GAE, from its turns' discounted returns G_1..G_k.

    Turn j's own reward `G_j - discount * G_{j+1}` sits on its last sampled token, and the last
    turn gets its whole return G_k, which is its own reward plus the discounted return of every
    later turn of the trajectory (later segments): the segment's tail is the Monte Carlo return
    rather than a bootstrap, and with one final reward and gamma = 1 each turn's token reward is
    0 but the last one, which is that reward. GAE then discounts once per turn (`turn_discounts`),
    so with V = 0 and lambda = 1 every token of turn j gets G_j.
    """
    g = [*returns, 0.0]
    own = [g[j] - discount * g[j + 1] for j in range(len(returns) - 1)]
    per_turn = [*own, g[len(returns) - 1]] if returns else []
    return rewards_at_turn_ends(
        torch.tensor(per_turn, dtype=torch.float64), spans, length, discount
    )


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
    discounts: list[list[float]] | None = None,
) -> list[TrainSequence]:
    """Final token advantages without a critic: each sequence's turn values (`build_sequences`)
    plus the reward-to-go of its KL token rewards, if any (discounted per turn by `discounts`,
    `Built.discounts`, 1 per token without them; AReaL's GAE with V = 0 and lambda = 1), then
    batch normalisation when `adv_norm` is batch."""
    if not seqs:
        return []
    advs: list[torch.Tensor] = []
    for k, s in enumerate(seqs):
        adv_T = torch.tensor(s.advantages, dtype=torch.float64)
        mask_T = torch.tensor(s.loss_mask, dtype=torch.bool)
        if kl_rewards is not None:
            kl_T = torch.tensor(kl_rewards[k], dtype=torch.float64)
            g_T = torch.tensor(discounts[k], dtype=torch.float64) if discounts else 1.0
            adv_T = adv_T + reward_to_go(kl_T, mask_T, g_T)
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
    discounts: list[list[float]] | None = None,
) -> list[TrainSequence]:
    """The sequences with GAE advantages (batch-normalised when `adv_norm` is batch), the critic's
    old `values` and the `returns` it regresses on, all 0 off the loss mask. `kl_rewards` (the KL
    penalty in the reward, `kl_token_rewards`) are added to the token rewards first.

    `values[i][t]` is the critic's value of the state before token t (`forward_values`). GAE runs
    over each sequence's sampled tokens only (`trainer.algorithms.gae`, the per-turn discount
    `discounts` of `Built.discounts`, 1 per token without them, lambda = `algo.lam`), in
    float64; padding the batch to one width changes nothing because padded positions are
    masked.
    """
    if not seqs:
        return []
    width = max(len(s) for s in seqs)
    r_BT = torch.zeros(len(seqs), width, dtype=torch.float64)
    v_BT = torch.zeros_like(r_BT)
    m_BT = torch.zeros(len(seqs), width, dtype=torch.bool)
    g_BT = torch.ones_like(r_BT)
    for b, (s, r, v) in enumerate(zip(seqs, token_rewards, values, strict=True)):
        n = len(s)
        if discounts is not None:
            g_BT[b, :n] = torch.tensor(discounts[b], dtype=torch.float64)
        r_BT[b, :n] = torch.tensor(r, dtype=torch.float64)
        if kl_rewards is not None:
            r_BT[b, :n] += torch.tensor(kl_rewards[b], dtype=torch.float64)
        v_BT[b, :n] = torch.tensor(v, dtype=torch.float64)
        m_BT[b, :n] = torch.tensor(s.loss_mask, dtype=torch.bool)
    adv_BT, ret_BT = gae(r_BT, v_BT, m_BT, g_BT, algo.lam)
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
