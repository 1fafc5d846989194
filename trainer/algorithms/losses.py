"""Policy, value, KL and entropy losses as pure functions over token-aligned tensors.

Legend: B = rows in a micro-batch (one sequence per row unless packed), T = token positions,
V = vocabulary. Every `_BT` tensor is aligned to tokens as in `advantages`: `logp_BT[b, t]` is the
log-probability of token t; `mask_BT` is 1 on sampled tokens.

Losses are reduced by `aggregation.aggregate` (see there for `agg`, `normalizer` and
`seq_index_BT`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import get_args

import torch

from trainer.algorithms.aggregation import aggregate, check_bt_shapes, per_sequence_sum
from trainer.algorithms.kinds import AggMode, BehavWeightMode, ImportanceLevel, KLKind

KL_CLAMP = 10.0
"""KL estimates are clamped to [-10, 10], as AReaL does."""


def _masked_mean(x_BT: torch.Tensor, m_BT: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    return torch.where(m_BT, x_BT, torch.zeros_like(x_BT)).sum() / n


def _masked_min_max(x_BT: torch.Tensor, m_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Min and max over the masked entries (0 and 0 when there are none), without a host sync."""
    inf = torch.full_like(x_BT, torch.inf)
    zero = torch.zeros((), dtype=x_BT.dtype, device=x_BT.device)
    some = m_BT.any()
    lo = torch.where(m_BT, x_BT, inf).amin()
    hi = torch.where(m_BT, x_BT, -inf).amax()
    return torch.where(some, lo, zero), torch.where(some, hi, zero)


def _behaviour_weight(
    log_w_BT: torch.Tensor,
    w_BT: torch.Tensor,
    m_BT: torch.Tensor,
    cap: float | None,
    mode: BehavWeightMode,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(keep_BT, applied_BT, truncated_BT) for the detached behaviour weight w = exp(log_w) (w_BT,
    which may be inf): the tokens the loss keeps, the weight it multiplies them by (1 elsewhere),
    and the tokens whose weight was truncated to the cap. The exponent is taken again only where
    the token is kept and its weight at most the cap, so `applied_BT` is finite with a cap."""
    keep, truncated = m_BT, torch.zeros_like(m_BT)
    if cap is not None:
        if mode == "mask":
            keep = m_BT & (w_BT <= cap)
        elif mode == "icepop":
            keep = m_BT & (w_BT >= 1.0 / cap) & (w_BT <= cap)
        else:
            truncated = m_BT & (w_BT > cap)
    exponent = torch.where(keep & ~truncated, log_w_BT, torch.zeros_like(log_w_BT))
    applied = torch.where(truncated, cap if cap is not None else 1.0, torch.exp(exponent))
    return keep, applied, truncated


def ppo_policy_loss(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    adv_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
    dual_clip_c: float | None = None,
    behav_logp_BT: torch.Tensor | None = None,
    behav_imp_weight_cap: float | None = None,
    behav_imp_weight_mode: BehavWeightMode = "mask",
    level: ImportanceLevel = "token",
    agg: AggMode = "token_mean",
    norm_len: float | None = None,
    normalizer: float | None = None,
    seq_index_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate, with AReaL's decoupled form and GSPO's sequence-level ratio.

    `logp_BT` is the policy being trained (carries the gradient). `old_logp_BT` is what the ratio
    is taken against: pi_old in standard PPO; pi_prox (recomputed with the current weights before
    the update) in decoupled PPO. Per token, with u = exp(logp - old_logp):

        l = max(-A u, -A clip(u, 1 - eps_low, 1 + eps_high))       (eps_high > eps_low: DAPO)
        l = min(l, c |A|)                if dual_clip_c = c (binds only for A < 0)
        l = w l,  w = exp(old_logp - behav_logp) (detached)  if behav_logp_BT is given

    i.e. decoupled PPO, the AReaL paper's Eq. 5 `-(pi_prox/pi_behav) min(u A, clip(u) A)`. The
    cap c_w = behav_imp_weight_cap (> 1) corrects the engine-vs-trainer mismatch w as
    `behav_imp_weight_mode` says:

    - "mask" (MIS; AReaL's token/mask/ratio rejection): tokens with w > c_w are dropped;
    - "truncate" (TIS): w becomes min(w, c_w), every token kept;
    - "icepop": tokens with w outside [1/c_w, c_w] are dropped.

    Dropped tokens still count in the normalizer. Without a cap, w is applied as it is. Unlike
    AReaL, w is always applied when behaviour logprobs are given (AReaL skips it without a
    rejection config).

    Numerics: the loss is computed branch by branch, l = -A r with r = u where the clip and the
    dual clip leave u free and r = the bound (1 - eps_low, 1 + eps_high or c) where they bind.
    The exponent of u (and of w) is taken only where the token is kept and u is free, so a clipped
    or dropped token never puts inf into the forward or the backward pass: its gradient is
    exactly 0, whatever its log-ratio or log-weight. Only what the loss leaves unbounded can
    overflow: u of a free token with A < 0 and no dual clip, and w without a cap.

    level "sequence" (GSPO): u_b = exp(mean over row b's sampled tokens of (logp - old_logp)) and
    A_b = the row's mean advantage, both broadcast to the row's tokens; the clip applies to u_b.

    Stats (0-dim tensors, over sampled tokens): clip_frac_low / clip_frac_high (the clip binds:
    A < 0 and u < 1 - eps_low / A > 0 and u > 1 + eps_high), dual_clip_frac, ratio_mean/min/max,
    imp_weight_mean/min/max (w before any truncation; 1 when not decoupled), cap_masked_frac
    (dropped by mask or icepop), truncated_frac (truncated by truncate), approx_kl (the k3
    estimate of KL(behaviour || current), behaviour = old_logp when not decoupled),
    approx_kl_prox (the same against old_logp: how far the update moved the policy from the
    proximal one).
    """
    check_bt_shapes(logp_BT=logp_BT, old_logp_BT=old_logp_BT, adv_BT=adv_BT, mask_BT=mask_BT)
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be > 1 (it caps the loss at c*|A|), got {dual_clip_c}")
    if behav_imp_weight_mode not in get_args(BehavWeightMode):
        raise ValueError(
            f"unknown behav_imp_weight_mode {behav_imp_weight_mode!r}: use mask, truncate or icepop"
        )
    if behav_imp_weight_cap is not None:
        if behav_logp_BT is None:
            raise ValueError("behav_imp_weight_cap needs behav_logp_BT (the decoupled loss)")
        if behav_imp_weight_cap <= 1.0:
            raise ValueError(
                f"behav_imp_weight_cap must be > 1 (it bounds pi_prox / pi_behav), got "
                f"{behav_imp_weight_cap}: use e.g. 5.0, or None to apply the weight uncapped"
            )
    elif behav_imp_weight_mode != "mask":
        raise ValueError(f"behav_imp_weight_mode {behav_imp_weight_mode!r} needs a cap")
    m = mask_BT.bool()
    zeros = torch.zeros_like(logp_BT)
    old = old_logp_BT.detach()
    adv = adv_BT.detach()

    behav = old
    log_w_BT = zeros
    if behav_logp_BT is not None:
        check_bt_shapes(logp_BT=logp_BT, behav_logp_BT=behav_logp_BT)
        behav = behav_logp_BT.detach()
        log_w_BT = torch.where(m, old - behav, zeros)
    w_BT = torch.exp(log_w_BT)  # compared and reported, never multiplied: may be inf
    keep, weight_BT, truncated = _behaviour_weight(
        log_w_BT, w_BT, m, behav_imp_weight_cap, behav_imp_weight_mode
    )

    log_ratio_BT = torch.where(m, logp_BT - old, zeros)
    if level == "sequence":
        count_S, idx_BT = per_sequence_sum(m.to(zeros.dtype), seq_index_BT)
        n_S = count_S.clamp(min=1)
        log_ratio_BT = (per_sequence_sum(log_ratio_BT, seq_index_BT)[0] / n_S)[idx_BT]
        adv = (per_sequence_sum(torch.where(m, adv, zeros), seq_index_BT)[0] / n_S)[idx_BT]
    elif level != "token":
        raise ValueError(f"unknown importance level {level!r}: use token or sequence")
    ratio_BT = torch.exp(log_ratio_BT.detach())  # only compared, never multiplied: may be inf

    low, high = 1.0 - eps_low, 1.0 + eps_high
    clip_low_BT = (adv < 0) & (ratio_BT < low)
    clip_high_BT = (adv > 0) & (ratio_BT > high)
    bound_BT = torch.where(adv > 0, high, torch.full_like(zeros, low))
    dual_BT = torch.zeros_like(m)
    if dual_clip_c is not None:
        dual_BT = (adv < 0) & (ratio_BT > dual_clip_c)
        bound_BT = torch.where(dual_BT, dual_clip_c, bound_BT)
    free_BT = keep & (adv != 0) & ~(clip_low_BT | clip_high_BT | dual_BT)
    u_BT = torch.exp(torch.where(free_BT, log_ratio_BT, zeros))
    loss_BT = -adv * weight_BT * torch.where(free_BT, u_BT, bound_BT)
    loss_BT = torch.where(keep, loss_BT, zeros)
    loss = aggregate(
        loss_BT, mask_BT, agg, norm_len=norm_len, normalizer=normalizer, seq_index_BT=seq_index_BT
    )

    with torch.no_grad():
        n = m.sum().clamp(min=1)
        delta_BT = torch.where(m, logp_BT - behav, zeros)
        prox_delta_BT = torch.where(m, logp_BT - old, zeros)
        ratio_min, ratio_max = _masked_min_max(ratio_BT, m)
        w_min, w_max = _masked_min_max(w_BT, m)
        stats = {
            "clip_frac_low": _masked_mean(clip_low_BT.to(old.dtype), m, n),
            "clip_frac_high": _masked_mean(clip_high_BT.to(old.dtype), m, n),
            "dual_clip_frac": _masked_mean(dual_BT.to(old.dtype), m, n),
            "ratio_mean": _masked_mean(ratio_BT, m, n),
            "ratio_min": ratio_min,
            "ratio_max": ratio_max,
            "imp_weight_mean": _masked_mean(w_BT, m, n),
            "imp_weight_min": w_min,
            "imp_weight_max": w_max,
            "cap_masked_frac": _masked_mean((m & ~keep).to(old.dtype), m, n),
            "truncated_frac": _masked_mean(truncated.to(old.dtype), m, n),
            "approx_kl": _masked_mean(delta_BT.exp() - 1 - delta_BT, m, n),
            "approx_kl_prox": _masked_mean(prox_delta_BT.exp() - 1 - prox_delta_BT, m, n),
        }
    return loss, {k: v.detach() for k, v in stats.items()}


def _clamped_estimate(
    estimate: Callable[[torch.Tensor], torch.Tensor], d_BT: torch.Tensor
) -> torch.Tensor:
    """`estimate(d).clamp(-KL_CLAMP, KL_CLAMP)` with a gradient that is finite everywhere: the
    differentiable estimate is taken only where it lies within the clamp (d = 0 elsewhere), so an
    estimate that overflows past it (k3 at d << 0) never reaches the backward pass."""
    with torch.no_grad():
        full_BT = estimate(d_BT)
        inside_BT = full_BT.abs() <= KL_CLAMP
        clamped_BT = full_BT.clamp(-KL_CLAMP, KL_CLAMP)
    inner_BT = estimate(torch.where(inside_BT, d_BT, torch.zeros_like(d_BT)))
    return torch.where(inside_BT, inner_BT, clamped_BT)


def _k1(d: torch.Tensor) -> torch.Tensor:
    return d


def _k2(d: torch.Tensor) -> torch.Tensor:
    return 0.5 * d.square()


def _k3(d: torch.Tensor) -> torch.Tensor:
    return torch.exp(-d) - 1 + d


_KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "k1": _k1,
    "k2": _k2,
    "k3": _k3,
}


def kl_penalty(logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor, kind: KLKind) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy, clamped to
    [-KL_CLAMP, KL_CLAMP] (no gradient past the clamp, and a finite one everywhere, even where
    the unclamped estimate overflows). With d = logp - ref_logp: k1 = d, k2 = d^2 / 2,
    k3 = exp(-d) - 1 + d (unbiased and >= 0). As a loss term:
    `kl_coef * aggregate(kl_penalty(...), mask_BT, agg)`; as a reward: `-kl_coef * kl` per token."""
    if kind not in _KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}: use k1, k2 or k3")
    return _clamped_estimate(_KL_ESTIMATORS[kind], logp_BT - ref_logp_BT.detach())


def logprob_mismatch(
    trainer_logp_BT: torch.Tensor, behav_logp_BT: torch.Tensor, mask_BT: torch.Tensor
) -> dict[str, torch.Tensor]:
    """How far the trainer's logprobs of the sampled tokens are from the engine's that sampled
    them (the mismatch the behaviour-weight cap corrects), over the masked tokens, with
    delta = trainer - behav: mismatch_abs_mean and mismatch_abs_max of |delta|, and mismatch_kl,
    the mean k3 estimate `exp(delta) - 1 - delta` of KL(behav || trainer). 0-dim float64 tensors,
    all 0 when the mask is empty. Detached, computed in float64 (exp(delta) is finite for any
    |delta| < 709) and only from masked positions (others may hold anything, inf included)."""
    check_bt_shapes(trainer_logp_BT=trainer_logp_BT, behav_logp_BT=behav_logp_BT, mask_BT=mask_BT)
    m = mask_BT.bool()
    with torch.no_grad():
        trainer = trainer_logp_BT.detach().to(torch.float64)
        behav = behav_logp_BT.detach().to(torch.float64)
        zeros = torch.zeros_like(trainer)
        delta_BT = torch.where(m, trainer - behav, zeros)
        n = m.sum().clamp(min=1)
        abs_BT = delta_BT.abs()
        return {
            "mismatch_abs_mean": _masked_mean(abs_BT, m, n),
            "mismatch_abs_max": _masked_min_max(abs_BT, m)[1],
            "mismatch_kl": _masked_mean(delta_BT.exp() - 1 - delta_BT, m, n),
        }


def entropy_from_logits(logits_BTV: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) per position, in at least float32 (pass logits / temperature
    for the sampled distribution). Stable for large finite logits: uses log_softmax."""
    x = logits_BTV.to(torch.promote_types(logits_BTV.dtype, torch.float32))
    logp_BTV = torch.log_softmax(x, dim=-1)
    return -(logp_BTV.exp() * logp_BTV).sum(-1)


def value_loss(
    values_BT: torch.Tensor,
    old_values_BT: torch.Tensor,
    returns_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    value_clip: float | None,
    agg: AggMode = "token_mean",
    norm_len: float | None = None,
    normalizer: float | None = None,
    seq_index_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO critic loss (AReaL's `ppo_critic_loss_fn`, MSE form):
    `max((V - R)^2 / 2, (V_old + clip(V - V_old, -value_clip, value_clip) - R)^2 / 2)` per token,
    or just the first term when value_clip is None. Stats: value_clip_frac (the clipped term is
    larger), value_mean, returns_mean."""
    check_bt_shapes(values_BT=values_BT, old_values_BT=old_values_BT, returns_BT=returns_BT)
    old, ret = old_values_BT.detach(), returns_BT.detach()
    loss_BT = 0.5 * (values_BT - ret).square()
    clipped_BT = torch.zeros_like(mask_BT, dtype=torch.bool)
    if value_clip is not None:
        v_clipped_BT = old + (values_BT - old).clamp(-value_clip, value_clip)
        loss_clipped_BT = 0.5 * (v_clipped_BT - ret).square()
        clipped_BT = loss_clipped_BT.detach() > loss_BT.detach()
        loss_BT = torch.maximum(loss_BT, loss_clipped_BT)
    loss = aggregate(
        loss_BT, mask_BT, agg, norm_len=norm_len, normalizer=normalizer, seq_index_BT=seq_index_BT
    )
    with torch.no_grad():
        m = mask_BT.bool()
        n = m.sum().clamp(min=1)
        stats = {
            "value_clip_frac": _masked_mean(clipped_BT.to(old.dtype), m, n),
            "value_mean": _masked_mean(values_BT.detach(), m, n),
            "returns_mean": _masked_mean(ret, m, n),
        }
    return loss, stats


def explained_variance(
    values_BT: torch.Tensor, returns_BT: torch.Tensor, mask_BT: torch.Tensor
) -> torch.Tensor:
    """How much of the returns' variance the critic explains: `1 - Var(R - V) / Var(R)` over the
    masked entries (population variances). 1 is a perfect critic, 0 one no better than the mean
    return, negative worse. Defined as 0 when the returns have no variance (or nothing is
    masked), so the metric stays finite."""
    check_bt_shapes(values_BT=values_BT, returns_BT=returns_BT)
    m = mask_BT.bool()
    n = m.sum().clamp(min=1)
    v, r = values_BT.detach(), returns_BT.detach()
    r_mean = _masked_mean(r, m, n)
    var_r = _masked_mean((r - r_mean).square(), m, n)
    diff = r - v
    var_d = _masked_mean((diff - _masked_mean(diff, m, n)).square(), m, n)
    safe = torch.where(var_r > 0, var_r, torch.ones_like(var_r))
    return torch.where(var_r > 0, 1 - var_d / safe, torch.zeros_like(var_r))
