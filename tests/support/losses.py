"""The loss tests' inputs and references (tests/unit/trainer/test_algorithms_losses.py and
test_algorithms_loss_terms.py): random float64 batches, the policy loss's variants, and an
independent float64 reference of the policy loss written as plain Python loops."""

from __future__ import annotations

import math
from typing import Any

import torch

from trainer.algorithms import (
    ppo_policy_loss,
)

F64 = torch.float64
AGGS = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "token_sum"]
NORM_LEN = 7.0
Rows = list[list[float]]


def batch(seed: int, B: int = 3, T: int = 6) -> dict[str, torch.Tensor]:
    """Random float64 inputs with some clipped ratios, mixed-sign advantages and some importance
    weights above 2.0."""
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=gen, dtype=F64) * 3
    logp = old + 0.3 * torch.randn(B, T, generator=gen, dtype=F64)
    behav = old + 0.8 * torch.randn(B, T, generator=gen, dtype=F64)
    adv = torch.randn(B, T, generator=gen, dtype=F64)
    mask = torch.rand(B, T, generator=gen) > 0.3
    mask[:, 0] = False
    mask[0, 1] = True
    return {"logp": logp, "old": old, "behav": behav, "adv": adv, "mask": mask}


def ref_policy_loss(
    logp: Rows,
    old: Rows,
    adv: Rows,
    mask: list[list[bool]],
    *,
    eps_low: float,
    eps_high: float,
    c: float | None = None,
    behav: Rows | None = None,
    cap: float | None = None,
    mode: str = "mask",
    level: str = "token",
    agg: str = "token_mean",
    seqs: list[list[tuple[int, int]]] | None = None,
) -> tuple[float, dict[str, float]]:
    B, T = len(logp), len(logp[0])
    if seqs is None:
        seqs = [[(b, t) for t in range(T)] for b in range(B)]
    ratio: dict[tuple[int, int], float] = {}
    a_of: dict[tuple[int, int], float] = {}
    for seq in seqs:
        sampled = [(b, t) for b, t in seq if mask[b][t]]
        for b, t in sampled:
            if level == "sequence":
                n = len(sampled)
                ratio[b, t] = math.exp(sum(logp[i][j] - old[i][j] for i, j in sampled) / n)
                a_of[b, t] = sum(adv[i][j] for i, j in sampled) / n
            else:
                ratio[b, t] = math.exp(logp[b][t] - old[b][t])
                a_of[b, t] = adv[b][t]
    loss: dict[tuple[int, int], float] = {}
    n_low = n_high = n_dropped = n_truncated = n_dual = 0
    weights, kls, prox_kls = [], [], []
    for (b, t), u in ratio.items():
        a = a_of[b, t]
        u_clip = min(max(u, 1 - eps_low), 1 + eps_high)
        l_tok = max(-a * u, -a * u_clip)
        n_low += a < 0 and u < 1 - eps_low
        n_high += a > 0 and u > 1 + eps_high
        if c is not None and a < 0 and l_tok > c * abs(a):
            l_tok = c * abs(a)
            n_dual += 1
        base = old[b][t]
        w = 1.0
        if behav is not None:
            base = behav[b][t]
            w = math.exp(old[b][t] - behav[b][t])
            applied, dropped = w, False
            if cap is not None and mode == "mask":
                dropped = w > cap
            elif cap is not None and mode == "icepop":
                dropped = not 1 / cap <= w <= cap
            elif cap is not None and mode == "truncate" and w > cap:
                applied = cap
                n_truncated += 1
            l_tok *= applied
            if dropped:
                l_tok = 0.0
                n_dropped += 1
        weights.append(w)
        d = logp[b][t] - base
        kls.append(math.exp(d) - 1 - d)
        d_prox = logp[b][t] - old[b][t]  # against the proximal policy, whatever the behaviour
        prox_kls.append(math.exp(d_prox) - 1 - d_prox)
        loss[b, t] = l_tok
    n_tok = len(loss)
    per_seq = [[loss[p] for p in seq if p in loss] for seq in seqs]
    per_seq = [s for s in per_seq if s]
    if agg == "token_mean":
        total = sum(loss.values()) / n_tok
    elif agg == "token_sum":
        total = sum(loss.values())
    elif agg == "seq_mean_token_mean":
        total = sum(sum(s) / len(s) for s in per_seq) / len(per_seq)
    else:
        total = sum(sum(s) / NORM_LEN for s in per_seq) / len(per_seq)
    stats = {
        "clip_frac_low": n_low / n_tok,
        "clip_frac_high": n_high / n_tok,
        "cap_masked_frac": n_dropped / n_tok,
        "truncated_frac": n_truncated / n_tok,
        "dual_clip_frac": n_dual / n_tok,
        "ratio_mean": sum(ratio.values()) / n_tok,
        "imp_weight_mean": sum(weights) / n_tok,
        "imp_weight_max": max(weights),
        "imp_weight_min": min(weights),
        "approx_kl": sum(kls) / n_tok,
        "approx_kl_prox": sum(prox_kls) / n_tok,
    }
    return total, stats


VARIANTS: dict[str, dict[str, Any]] = {
    "ppo": {},
    "ppo_dual_clip": {"dual_clip_c": 1.1},
    "decoupled_cap": {"decoupled": True, "behav_imp_weight_cap": 2.0, "dual_clip_c": 3.0},
    "decoupled_truncate": {
        "decoupled": True,
        "behav_imp_weight_cap": 2.0,
        "behav_imp_weight_mode": "truncate",
    },
    "decoupled_icepop": {
        "decoupled": True,
        "behav_imp_weight_cap": 2.0,
        "behav_imp_weight_mode": "icepop",
        "dual_clip_c": 3.0,
    },
    "gspo": {"level": "sequence"},
    "gspo_decoupled": {"level": "sequence", "decoupled": True, "behav_imp_weight_cap": 2.0},
}


def run_loss(
    d: dict[str, torch.Tensor], variant: dict[str, Any], agg: str, **extra: Any
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    kw = dict(variant)
    decoupled = kw.pop("decoupled", False)
    return ppo_policy_loss(
        d["logp"],
        d["old"],
        d["adv"],
        d["mask"],
        eps_low=0.1,
        eps_high=0.15,
        behav_logp_BT=d["behav"] if decoupled else None,
        agg=agg,  # type: ignore[arg-type]
        norm_len=NORM_LEN,
        **kw,
        **extra,
    )
