"""An independent float64 reference of one training step, to hold the real trainer to.

Written from the math of the step (AReaL's order), not from `trainer/`: it imports only the
config types (`TrainConfig`, `AlgorithmConfig`) and the store's dataclasses. Everything is plain
torch in float64, one sequence per forward pass (no packing), loops where a loop is clearer:

0. truncated turns (`zero_truncated_reward`): a turn whose finish reason is `length` counts
   its reward (and the final reward, on the last turn) as 0; the returns are summed again,
   `G_i = r_i + discount * G_{i+1}`, and the episode reward is the sum of the r_i;
1. overlong shaping: `r' = r + clamp(-(L - (max_tokens - buffer)) / buffer * factor, -factor, 0)`,
   with L the trajectory's longest sampled span; `shift = r' - r`;
2. dynamic sampling: drop every group whose task rewards (before shaping) are all equal (a
   group of one too);
3. multi-turn credit: turn i's value is `(G_i + shift - b_gi) * scale_gi`, the baseline and
   scale taken over the values `G_i + shift` of the trajectories of group g that have a turn i
   (mean_std, mean, leave_one_out, none; a turn position only one member reached gets 0 in
   every mode but none);
4. one sequence per segment with a sampled token of a turn the trainer can reproduce (not
   greedy, truncated, nor with min tokens: such a turn stays context, and a segment of only such
   turns is left out); each token at the temperature of the turn that sampled it;
5. proximal (decoupled) and reference (KL) logprobs under the initial weights;
6. token advantages: the turn values on their tokens, plus a KL reward-to-go when the KL is
   placed in the reward, discounted by the run's `discount` once per turn crossed (1 inside
   a turn);
7. batch normalisation of the advantages;
8. mini-batches balanced by token count, `ppo_epochs` passes, one AdamW step each;
9. the PPO-family loss per mini-batch (clip, dual clip, decoupled weight and cap, token or
   sequence ratio, the four aggregations, KL in the loss, entropy bonus).

`reference_step` returns the float64 weights after the step and what each optimizer step saw.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from store.types import Segment, Trajectory
from trainer.algorithms.config import AlgorithmConfig
from trainer.config import TrainConfig

F64 = torch.float64
KL_CLAMP = 10.0


@dataclass
class RefSequence:
    """One training sequence of the reference: per-token float64 tensors of length T."""

    tokens: list[int]
    mask_T: torch.Tensor
    """bool: sampled by a turn the trainer can reproduce (the loss mask)."""
    temp_T: torch.Tensor
    """Temperature each token is scored at."""
    behav_T: torch.Tensor
    raw_adv_T: torch.Tensor
    """The turns' values against the group baseline on their tokens (0 off the mask)."""
    adv_T: torch.Tensor
    """Advantages after the KL reward and batch normalisation (0 off the mask)."""
    prox_T: torch.Tensor | None = None
    ref_T: torch.Tensor | None = None
    kl_reward_T: torch.Tensor | None = None
    """kl_t of the KL placed in the reward (before `-kl_coef`), 0 off the mask."""
    turn_T: torch.Tensor | None = None
    """The index of the turn (within the segment) that sampled each trained token; -1 off."""

    @property
    def n_loss(self) -> int:
        return int(self.mask_T.sum())


@dataclass
class ReferenceStep:
    """What one reference step did. `state` and `initial` are float64 state dicts."""

    state: dict[str, torch.Tensor]
    initial: dict[str, torch.Tensor]
    sequences: list[RefSequence]
    minibatches: list[list[int]]
    """Sequence indices of each mini-batch (ascending), in step order within one epoch."""
    kept: list[int]
    """Indices of the trajectories that produced sequences."""
    dropped: list[int]
    """Indices of the trajectories left out (dynamic sampling, nothing sampled)."""
    shaped_rewards: list[float]
    """Per trajectory given, its reward after overlong shaping."""
    untrainable_turns: int
    losses: list[float] = field(default_factory=list)
    """Per optimizer step (epoch-major), the mini-batch's loss."""
    grad_norms: list[float] = field(default_factory=list)
    """Per optimizer step, the global gradient norm before clipping."""
    stats: dict[str, float] = field(default_factory=dict)
    """Over every optimizer step: fractions token-weighted, ratio/weight min and max, entropy
    (mean over trained tokens), kl_ref (mean kl over trained tokens) when a KL is configured."""

    def update_vector(self) -> torch.Tensor:
        """All parameters' change, flattened in the state dict's key order."""
        return torch.cat([(self.state[k] - self.initial[k]).flatten() for k in sorted(self.state)])


# -- the model -------------------------------------------------------------------------------------


def load_model(model_dir: str | Path) -> Any:
    """The HF causal LM of `model_dir` in float64 with eager attention."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=F64, attn_implementation="eager"
    )
    model.config.use_cache = False
    model.eval()  # no dropout: the tiny model has none, and the reference is deterministic
    return model


def score(model: Any, tokens: list[int], temp_T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp_T, entropy_T) of one sequence, both float64 of length T and 0 at t = 0:
    `logp_T[t] = log_softmax(logits[t - 1] / temp_T[t])[tokens[t]]` and `entropy_T[t]` the
    entropy of that distribution. Differentiable when grad is enabled."""
    ids = torch.tensor([tokens], dtype=torch.long)
    logits_TV = model(input_ids=ids, use_cache=False).logits[0].to(F64)
    scaled_TV = logits_TV[:-1] / temp_T[1:, None]
    logsm_TV = torch.log_softmax(scaled_TV, dim=-1)
    logp = logsm_TV.gather(-1, ids[0, 1:, None])[:, 0]
    entropy = -(logsm_TV.exp() * logsm_TV).sum(-1)
    zero = torch.zeros(1, dtype=F64)
    return torch.cat([zero, logp]), torch.cat([zero, entropy])


def initial_logprobs(
    model_dir: str | Path, tokens: list[list[int]], temps: list[torch.Tensor]
) -> list[torch.Tensor]:
    """Each sequence's token logprobs under the initial weights (for building test inputs)."""
    model = load_model(model_dir)
    with torch.no_grad():
        return [score(model, t, tt)[0] for t, tt in zip(tokens, temps, strict=True)]


# -- steps 1-3: shaping, filtering, baselines -----------------------------------------------------


def _group_of(t: Trajectory, i: int) -> str:
    gid = t.session.group_id
    return f"group:{gid}" if gid is not None else f"alone:{i}"


def _longest_span(t: Trajectory) -> int:
    return max((end - start for s in t.segments for start, end in s.turn_spans), default=0)


def shaped_rewards(trajs: list[Trajectory], cfg: TrainConfig, algo: AlgorithmConfig) -> list[float]:
    """Step 1: each trajectory's reward after DAPO's overlong shaping (unchanged when off): the
    penalty grows linearly over the buffer and stays at `-factor` past max_tokens."""
    buffer, max_tokens = algo.overlong_buffer, cfg.max_tokens
    if buffer is None or max_tokens is None:
        return [t.reward for t in trajs]
    out = []
    factor = algo.overlong_penalty_factor
    for t in trajs:
        excess = _longest_span(t) - (max_tokens - buffer)
        penalty = max(min(-excess / buffer * factor, 0.0), -factor)
        out.append(t.reward + penalty)
    return out


def without_truncated_rewards(
    trajs: list[Trajectory], cfg: TrainConfig, algo: AlgorithmConfig
) -> list[Trajectory]:
    """Step 0: each trajectory with its cut turns' rewards taken away (unchanged when off)."""
    if not algo.zero_truncated_reward:
        return trajs
    out = []
    for t in trajs:
        r = {
            cid: 0.0 if t.finish_reasons[cid] == "length" else t.turn_rewards[cid]
            for cid in t.returns
        }
        returns: dict[str, float] = {}
        g = 0.0
        for cid in reversed(list(r)):
            g = r[cid] + cfg.discount * g
            returns[cid] = g
        out.append(
            replace(
                t, returns={cid: returns[cid] for cid in r}, reward=sum(r.values()), turn_rewards=r
            )
        )
    return out


def kept_after_dynamic_sampling(trajs: list[Trajectory], algo: AlgorithmConfig) -> list[int]:
    """Step 2: indices of the trajectories whose group's task rewards are not all equal."""
    if not algo.dynamic_sampling:
        return list(range(len(trajs)))
    members: dict[str, list[int]] = defaultdict(list)
    for i, t in enumerate(trajs):
        members[_group_of(t, i)].append(i)
    keep = []
    for i, t in enumerate(trajs):
        rewards = {trajs[j].reward for j in members[_group_of(t, i)]}
        if len(rewards) > 1:
            keep.append(i)
    return keep


def baselines(
    values: Mapping[Any, float], groups: Mapping[Any, str], mode: str, eps: float
) -> dict[Any, tuple[float, float]]:
    """Step 3: (baseline b, scale) per key from the values of the keys of its group (the
    caller's keys: one per turn, grouped by group and turn position)."""
    members: dict[str, list[Any]] = defaultdict(list)
    for i in values:
        members[groups[i]].append(i)
    out: dict[Any, tuple[float, float]] = {}
    for i, e in values.items():
        group = [values[j] for j in members[groups[i]]]
        n = len(group)
        if mode == "none":
            out[i] = (0.0, 1.0)
        elif n == 1:
            out[i] = (e, 1.0)
        elif mode == "mean":
            out[i] = (sum(group) / n, 1.0)
        elif mode == "leave_one_out":
            out[i] = ((sum(group) - e) / (n - 1), 1.0)
        elif mode == "mean_std":
            mean = sum(group) / n
            std = math.sqrt(sum((x - mean) ** 2 for x in group) / (n - 1))
            out[i] = (mean, 1.0 / (std + eps))
        else:
            raise ValueError(f"unknown group baseline {mode!r}")
    return out


# -- step 4: sequences ---------------------------------------------------------------------------


def reproducible(sampling: Mapping[str, Any]) -> bool:
    """Whether `log_softmax(logits / T)` is the distribution a turn was sampled from."""

    def num(key: str, default: float) -> float:
        value = sampling.get(key)
        return default if value is None else float(value)

    return not (
        num("temperature", 1.0) <= 0
        or num("top_p", 1.0) < 1
        or num("top_k", 0) > 0
        or num("min_p", 0) > 0
        or num("min_new_tokens", 0) > 0
    )


def turn_sampling(seg: Segment) -> list[Mapping[str, Any]]:
    """The segment's per-turn sampling settings ({} for each turn when none are recorded)."""
    recorded: list[Mapping[str, Any]] = list(seg.turn_sampling)
    return recorded + [{}] * (len(seg.completion_ids) - len(recorded))


def segment_sequence(
    seg: Segment, turn_values: list[float], run_temperature: float
) -> tuple[RefSequence, int]:
    """The segment as a sequence with raw turn-value advantages, and its untrainable turns."""
    n = len(seg.tokens)
    mask = torch.zeros(n, dtype=torch.bool)
    temp = torch.full((n,), float(run_temperature), dtype=F64)
    adv = torch.zeros(n, dtype=F64)
    turn = torch.full((n,), -1, dtype=torch.long)
    untrainable = 0
    for k, ((start, end), sampling) in enumerate(
        zip(seg.turn_spans, turn_sampling(seg), strict=True)
    ):
        ok = reproducible(sampling)
        untrainable += not ok
        t = sampling.get("temperature")
        for pos in range(start, end):
            if ok and seg.loss_mask[pos]:
                mask[pos] = True
                turn[pos] = k
                adv[pos] = turn_values[k]
                temp[pos] = float(t) if t is not None else float(run_temperature)
    behav = torch.tensor(seg.logprobs, dtype=F64) * mask
    seq = RefSequence(
        tokens=list(seg.tokens),
        mask_T=mask,
        temp_T=temp,
        behav_T=behav,
        raw_adv_T=adv,
        adv_T=adv.clone(),
        turn_T=turn,
    )
    return seq, untrainable


# -- steps 5-9 -----------------------------------------------------------------------------------


def kl_estimate(d: torch.Tensor, kind: str) -> torch.Tensor:
    """k1 = d, k2 = d^2 / 2, k3 = exp(-d) - 1 + d, clamped to [-10, 10]."""
    if kind == "k1":
        kl = d
    elif kind == "k2":
        kl = d * d / 2
    elif kind == "k3":
        kl = torch.exp(-d) - 1 + d
    else:
        raise ValueError(f"unknown KL kind {kind!r}")
    return kl.clamp(-KL_CLAMP, KL_CLAMP)


def reward_to_go(
    r_T: torch.Tensor, mask_T: torch.Tensor, turn_T: torch.Tensor, discount: float
) -> torch.Tensor:
    """Sum over the masked positions from each masked position on (0 elsewhere), each later
    reward discounted once per turn between them: `discount ** (turn(t') - turn(t))`."""
    out = torch.zeros_like(r_T)
    running, later_turn = 0.0, None
    for t in reversed(range(len(r_T))):
        if mask_T[t]:
            k = int(turn_T[t])
            factor = 1.0 if later_turn is None else discount ** (later_turn - k)
            running = float(r_T[t]) + factor * running
            later_turn = k
            out[t] = running
    return out


def minibatch_partition(
    lengths: list[int], n: int, seed: str, units: list[list[int]] | None = None
) -> list[list[int]]:
    """One epoch's: the units (default each index alone) as `random.Random(seed)` shuffles them,
    each whole to the mini-batch with the fewest tokens so far (ties: the lowest index); each
    mini-batch's indices ascending. The trainer's seed of epoch e of step s is
    `{optim.seed}:{s}:{e}`."""
    units = [[i] for i in range(len(lengths))] if units is None else units
    n = min(n, len(units))
    bins: list[list[int]] = [[] for _ in range(n)]
    load = [0] * n
    order = list(range(len(units)))
    random.Random(seed).shuffle(order)
    for u in order:
        b = min(range(n), key=lambda j: (load[j], j))
        bins[b] += units[u]
        load[b] += sum(lengths[i] for i in units[u])
    return [sorted(b) for b in bins]


def same_prompt_units(seqs: list[RefSequence], n: int, shared: int = 16) -> list[list[int]]:
    """`ppo_minibatch_split: prefixes`: sequences whose untrained prompts (tokens before the
    first trained one, more than `shared` of them) are equal, in order of first appearance, any
    other alone; the largest halved while there are fewer than `n`."""
    units: dict[tuple[int, ...], list[int]] = {}
    for i, s in enumerate(seqs):
        mask = s.mask_T.tolist()
        prompt = tuple(s.tokens[: mask.index(True) if True in mask else len(mask)])
        units.setdefault(prompt if len(prompt) > shared else (-1 - i,), []).append(i)
    out = list(units.values())
    while len(out) < n and max(len(u) for u in out) > 1:
        k = max(range(len(out)), key=lambda j: (len(out[j]), -j))
        out[k : k + 1] = [out[k][: (len(out[k]) + 1) // 2], out[k][(len(out[k]) + 1) // 2 :]]
    return out


def _aggregate(
    per_token: list[torch.Tensor], masks: list[torch.Tensor], agg: str, norm_len: int | None
) -> torch.Tensor:
    """The mini-batch's aggregate of per-token values (lists of one tensor per sequence)."""
    total = torch.zeros((), dtype=F64)
    n_tokens = sum(int(m.sum()) for m in masks)
    n_seqs = sum(1 for m in masks if m.any())
    for x, m in zip(per_token, masks, strict=True):
        s = torch.where(m, x, torch.zeros_like(x)).sum()
        if agg in ("token_mean", "token_sum"):
            total = total + s
        elif agg == "seq_mean_token_mean":
            if m.any():
                total = total + s / int(m.sum())
        elif agg == "seq_mean_token_sum":
            assert norm_len is not None
            total = total + s / norm_len
        else:
            raise ValueError(f"unknown agg {agg!r}")
    if agg == "token_mean":
        return total / max(n_tokens, 1)
    if agg == "token_sum":
        return total
    return total / max(n_seqs, 1)


@dataclass
class _Tally:
    """Token-weighted sums of the per-token stats over every optimizer step."""

    tokens: int = 0
    sums: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    lows: dict[str, float] = field(default_factory=dict)
    highs: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, x: torch.Tensor, m: torch.Tensor) -> None:
        self.sums[name] += float(x[m].sum())

    def extremes(self, name: str, x: torch.Tensor, m: torch.Tensor) -> None:
        if m.any():
            self.lows[name] = min(self.lows.get(name, math.inf), float(x[m].min()))
            self.highs[name] = max(self.highs.get(name, -math.inf), float(x[m].max()))


def _behaviour_correction(
    weight: torch.Tensor, m: torch.Tensor, algo: AlgorithmConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """(keep, applied weight) for the behaviour weights w = pi_prox / pi_behav of one sequence
    under the cap c: mask keeps w <= c; icepop keeps 1/c <= w <= c; truncate keeps every token at
    min(w, c). No cap: every token kept at its w."""
    cap, mode = algo.behav_imp_weight_cap, algo.behav_imp_weight_mode
    if cap is None:
        return m, weight
    if mode == "mask":
        return m & (weight <= cap), weight
    if mode == "icepop":
        return m & (weight >= 1 / cap) & (weight <= cap), weight
    if mode == "truncate":
        return m, weight.clamp(max=cap)
    raise ValueError(f"unknown behav_imp_weight_mode {mode!r}")


def _minibatch_loss(
    model: Any,
    seqs: list[RefSequence],
    algo: AlgorithmConfig,
    tally: _Tally,
) -> torch.Tensor:
    """Step 9: the loss of one mini-batch (with grad), recording its stats in `tally`."""
    losses, kls, entropies, masks = [], [], [], []
    for s in seqs:
        logp, entropy = score(model, s.tokens, s.temp_T)
        m = s.mask_T
        zeros = torch.zeros_like(logp)
        old = s.prox_T if algo.decoupled else s.behav_T
        assert old is not None
        log_ratio = torch.where(m, logp - old, zeros)
        adv = s.adv_T
        if algo.importance_level == "sequence":
            n = max(int(m.sum()), 1)
            ratio = torch.exp(log_ratio.sum() / n).expand_as(logp)
            adv = torch.full_like(adv, float(adv[m].sum()) / n)
        else:
            ratio = torch.exp(log_ratio)
        surr = -adv * ratio
        surr_clip = -adv * ratio.clamp(1 - algo.eps_low, 1 + algo.eps_high)
        loss = torch.maximum(surr, surr_clip)
        clipped = surr.detach() < surr_clip.detach()
        tally.add("clip_frac_low", (clipped & (adv < 0)).to(F64), m)
        tally.add("clip_frac_high", (clipped & (adv > 0)).to(F64), m)
        if algo.dual_clip_c is not None:
            cap = algo.dual_clip_c * adv.abs()
            tally.add("dual_clip_frac", (loss.detach() > cap).to(F64), m)
            loss = torch.minimum(loss, cap)
        weight = torch.ones_like(logp)
        keep, applied = m, weight
        if algo.decoupled:
            assert s.prox_T is not None
            weight = torch.where(m, torch.exp(s.prox_T - s.behav_T), torch.ones_like(logp))
            keep, applied = _behaviour_correction(weight, m, algo)
            loss = applied * loss
        tally.add("cap_masked_frac", (m & ~keep).to(F64), m)
        tally.add("truncated_frac", (applied < weight).to(F64), m)
        losses.append(torch.where(keep, loss, zeros))
        masks.append(m)
        entropies.append(entropy)
        tally.add("entropy", entropy.detach(), m)
        tally.extremes("ratio", ratio.detach(), m)
        tally.extremes("imp_weight", weight, m)
        if algo.kl_coef > 0 and algo.kl_placement == "loss":
            assert s.ref_T is not None
            kl = kl_estimate(torch.where(m, logp - s.ref_T, zeros), algo.kl_kind)
            kls.append(kl)
            tally.add("kl_ref", kl.detach(), m)
        tally.tokens += int(m.sum())
    total = _aggregate(losses, masks, algo.agg, algo.norm_len)
    if kls:
        total = total + algo.kl_coef * _aggregate(kls, masks, algo.agg, algo.norm_len)
    if algo.entropy_coef > 0:
        total = total - algo.entropy_coef * _aggregate(entropies, masks, algo.agg, algo.norm_len)
    return total


def reference_step(
    trajs: list[Trajectory], cfg: TrainConfig, model_dir: str | Path, *, adam_eps: float = 1e-8
) -> ReferenceStep:
    """One training step of `cfg` on `trajs` from the initial weights of `model_dir`."""
    algo: AlgorithmConfig = cfg.algorithm_config()
    if algo.use_critic:
        raise ValueError("the reference has no critic: cover use_critic elsewhere")
    if cfg.optim.schedule != "constant" or cfg.optim.warmup_steps:
        raise ValueError("the reference steps at a constant learning rate")
    model = load_model(model_dir)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}

    # 0-3
    trajs = without_truncated_rewards(trajs, cfg, algo)
    shaped = shaped_rewards(trajs, cfg, algo)
    kept = kept_after_dynamic_sampling(trajs, algo)
    shift = {i: shaped[i] - trajs[i].reward for i in kept}
    turn_value = {
        (i, p): g + shift[i] for i in kept for p, g in enumerate(trajs[i].returns.values())
    }
    turn_group = {(i, p): f"{_group_of(trajs[i], i)}/turn {p}" for i, p in turn_value}
    base = baselines(turn_value, turn_group, algo.group_baseline, algo.norm_eps)

    # 4
    seqs: list[RefSequence] = []
    used: list[int] = []
    untrainable = 0
    for i in kept:
        t = trajs[i]
        position = {cid: p for p, cid in enumerate(t.returns)}
        produced = False
        for seg in t.segments:
            if not any(seg.loss_mask):
                continue
            values = []
            for cid in seg.completion_ids:
                b, scale = base[(i, position[cid])]
                values.append((t.returns[cid] + shift[i] - b) * scale)
            seq, bad = segment_sequence(seg, values, cfg.temperature)
            untrainable += bad
            if seq.n_loss:  # a segment of untrainable turns only is context for nothing
                seqs.append(seq)
                produced = True
        if produced:
            used.append(i)
    dropped = [i for i in range(len(trajs)) if i not in used]

    # 5
    with torch.no_grad():
        if algo.decoupled:
            for s in seqs:
                s.prox_T = score(model, s.tokens, s.temp_T)[0] * s.mask_T
        if algo.kl_coef > 0:
            reference = load_model(model_dir)
            for s in seqs:
                s.ref_T = score(reference, s.tokens, s.temp_T)[0] * s.mask_T

    # 6
    kl_sum, kl_count = 0.0, 0
    if algo.kl_coef > 0 and algo.kl_placement == "reward":
        for s in seqs:
            assert s.ref_T is not None
            kl = torch.where(
                s.mask_T, kl_estimate(s.behav_T - s.ref_T, algo.kl_kind), torch.zeros_like(s.ref_T)
            )
            s.kl_reward_T = kl
            assert s.turn_T is not None
            s.adv_T = s.adv_T + reward_to_go(-algo.kl_coef * kl, s.mask_T, s.turn_T, cfg.discount)
            kl_sum += float(kl[s.mask_T].sum())
            kl_count += s.n_loss

    # 7
    if algo.adv_norm == "batch" and seqs:
        flat = torch.cat([s.adv_T[s.mask_T] for s in seqs])
        mean = flat.mean()
        std = flat.std(unbiased=True) if flat.numel() > 1 else torch.zeros((), dtype=F64)
        for s in seqs:
            s.adv_T = torch.where(
                s.mask_T, (s.adv_T - mean) / (std + algo.norm_eps), torch.zeros_like(s.adv_T)
            )

    out = ReferenceStep(
        state={},
        initial=initial,
        sequences=seqs,
        minibatches=[],
        kept=used,
        dropped=dropped,
        shaped_rewards=shaped,
        untrainable_turns=untrainable,
    )
    if not seqs:
        out.state = initial
        return out

    # 8-9
    lengths = [len(s.tokens) for s in seqs]
    split, trees = algo.ppo_minibatch_split, getattr(cfg.backend, "prefix_sharing", False)
    prefixes = split == "prefixes" or (split == "auto" and trees)
    units = same_prompt_units(seqs, algo.ppo_n_minibatches) if prefixes else None
    epochs = [  # the first step (0) of a fresh trainer
        minibatch_partition(lengths, algo.ppo_n_minibatches, f"{cfg.optim.seed}:0:{e}", units)
        for e in range(algo.ppo_epochs)
    ]
    out.minibatches = epochs[0]
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=cfg.optim.lr,
        betas=(0.9, 0.999),
        eps=adam_eps,
        weight_decay=cfg.optim.weight_decay,
    )
    tally = _Tally()
    max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
    for epoch in epochs:
        for mb in epoch:
            optimizer.zero_grad(set_to_none=True)
            loss = _minibatch_loss(model, [seqs[i] for i in mb], algo, tally)
            torch.autograd.backward(loss)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            optimizer.step()
            out.losses.append(float(loss.detach()))
            out.grad_norms.append(float(norm))

    n = max(tally.tokens, 1)
    out.stats = {name: total / n for name, total in tally.sums.items()}
    for name in tally.lows:
        out.stats[f"{name}_min"] = tally.lows[name]
        out.stats[f"{name}_max"] = tally.highs[name]
    if kl_count:
        out.stats["kl_ref"] = kl_sum / kl_count
    out.stats["untrainable_turns"] = float(untrainable)
    out.state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out
