"""Losses against independent float64 references written as plain Python loops."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from trainer.algorithms import (
    aggregate,
    entropy_from_logits,
    explained_variance,
    kl_penalty,
    loss_normalizer,
    ppo_policy_loss,
    value_loss,
)
from trainer.algorithms.losses import logprob_mismatch

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


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("name", list(VARIANTS))
def test_policy_loss_and_stats_match_loop(name: str, agg: str) -> None:
    variant = VARIANTS[name]
    d = batch(3)
    loss, stats = run_loss(d, variant, agg)
    want, want_stats = ref_policy_loss(
        d["logp"].tolist(),
        d["old"].tolist(),
        d["adv"].tolist(),
        d["mask"].tolist(),
        eps_low=0.1,
        eps_high=0.15,
        c=variant.get("dual_clip_c"),
        behav=d["behav"].tolist() if variant.get("decoupled") else None,
        cap=variant.get("behav_imp_weight_cap"),
        mode=variant.get("behav_imp_weight_mode", "mask"),
        level=variant.get("level", "token"),
        agg=agg,
    )
    assert loss.item() == pytest.approx(want, abs=1e-12)
    for key, value in want_stats.items():
        assert stats[key].item() == pytest.approx(value, abs=1e-12), key
    if name == "ppo":  # the random batch exercises both clip sides
        assert want_stats["clip_frac_low"] > 0
        assert want_stats["clip_frac_high"] > 0
    if name == "ppo_dual_clip":
        assert want_stats["dual_clip_frac"] > 0
    if name == "decoupled_cap":
        assert 0 < want_stats["cap_masked_frac"] < 1
    if name == "decoupled_truncate":  # some weights above the cap, none dropped
        assert 0 < want_stats["truncated_frac"] < 1
        assert want_stats["cap_masked_frac"] == 0
    if name == "decoupled_icepop":  # dropped on both sides, more than mask drops
        assert want_stats["cap_masked_frac"] > masked_frac(d, VARIANTS["decoupled_cap"], agg)


def masked_frac(d: dict[str, torch.Tensor], variant: dict[str, Any], agg: str) -> float:
    return run_loss(d, variant, agg)[1]["cap_masked_frac"].item()


@pytest.mark.parametrize(
    "name",
    [
        "ppo_dual_clip",
        "decoupled_cap",
        "decoupled_truncate",
        "decoupled_icepop",
        "gspo",
        "gspo_decoupled",
    ],
)
def test_policy_loss_gradcheck(name: str) -> None:
    d = batch(4, B=2, T=5)
    variant = VARIANTS[name]

    def f(logp: torch.Tensor) -> torch.Tensor:
        return run_loss({**d, "logp": logp}, variant, "seq_mean_token_mean")[0]

    assert torch.autograd.gradcheck(f, (d["logp"].clone().requires_grad_(True),))


def grad_of(d: dict[str, torch.Tensor], variant: dict[str, Any], agg: str) -> torch.Tensor:
    logp = d["logp"].clone().requires_grad_(True)
    run_loss({**d, "logp": logp}, variant, agg)[0].backward()
    assert logp.grad is not None
    return logp.grad


def one_token(log_ratio: float, adv: float) -> dict[str, torch.Tensor]:
    t = torch.tensor
    return {
        "logp": t([[math.log(0.5) + log_ratio]], dtype=F64),
        "old": t([[math.log(0.5)]], dtype=F64),
        "behav": t([[math.log(0.5)]], dtype=F64),
        "adv": t([[adv]], dtype=F64),
        "mask": t([[True]]),
    }


def test_clip_higher_is_asymmetric() -> None:
    d = one_token(math.log(1.25), 1.0)
    clipped, s = ppo_policy_loss(
        d["logp"], d["old"], d["adv"], d["mask"], eps_low=0.2, eps_high=0.2
    )
    assert clipped.item() == pytest.approx(-1.2)
    assert s["clip_frac_high"].item() == 1.0
    assert s["clip_frac_low"].item() == 0.0
    free, s = ppo_policy_loss(d["logp"], d["old"], d["adv"], d["mask"], eps_low=0.2, eps_high=0.28)
    assert free.item() == pytest.approx(-1.25)
    assert s["clip_frac_high"].item() == 0.0
    assert grad_of(d, {}, "token_mean").item() == 0.0  # eps_high 0.15 in run_loss: clipped
    # the low side: A < 0, ratio 0.75 is clipped at 0.8 whatever eps_high is
    d = one_token(math.log(0.75), -1.0)
    low, s = ppo_policy_loss(d["logp"], d["old"], d["adv"], d["mask"], eps_low=0.2, eps_high=0.28)
    assert low.item() == pytest.approx(0.8)
    assert s["clip_frac_low"].item() == 1.0


def test_dual_clip_caps_negative_advantages_only() -> None:
    d = one_token(math.log(5.0), -1.0)
    plain, _ = ppo_policy_loss(d["logp"], d["old"], d["adv"], d["mask"], eps_low=0.2, eps_high=0.2)
    assert plain.item() == pytest.approx(5.0)
    loss, s = ppo_policy_loss(
        d["logp"], d["old"], d["adv"], d["mask"], eps_low=0.2, eps_high=0.2, dual_clip_c=3.0
    )
    assert loss.item() == pytest.approx(3.0)
    assert s["dual_clip_frac"].item() == 1.0
    assert grad_of(d, {"dual_clip_c": 3.0}, "token_mean").item() == 0.0
    d = one_token(math.log(5.0), 1.0)
    loss, s = ppo_policy_loss(
        d["logp"], d["old"], d["adv"], d["mask"], eps_low=0.2, eps_high=0.2, dual_clip_c=3.0
    )
    assert loss.item() == pytest.approx(-1.2)
    assert s["dual_clip_frac"].item() == 0.0
    with pytest.raises(ValueError, match="dual_clip_c must be > 1"):
        ppo_policy_loss(
            d["logp"], d["old"], d["adv"], d["mask"], eps_low=0.2, eps_high=0.2, dual_clip_c=1.0
        )


@pytest.mark.parametrize("agg", AGGS)
def test_decoupled_equals_standard_when_behaviour_is_proximal(agg: str) -> None:
    d = batch(5)
    d["behav"] = d["old"].clone()
    std, _ = run_loss(d, {}, agg)
    dec, s = run_loss(d, {"decoupled": True, "behav_imp_weight_cap": 5.0}, agg)
    assert dec.item() == pytest.approx(std.item(), abs=1e-14)
    assert torch.allclose(grad_of(d, {}, agg), grad_of(d, {"decoupled": True}, agg), atol=1e-14)
    assert s["imp_weight_mean"].item() == 1.0
    assert s["cap_masked_frac"].item() == 0.0


def test_on_policy_ratio_is_one_and_nothing_is_clipped() -> None:
    d = batch(6)
    d["logp"] = d["old"].clone()
    loss, s = run_loss(d, {"dual_clip_c": 2.0}, "token_mean")
    m = d["mask"]
    assert loss.item() == pytest.approx(-d["adv"][m].mean().item(), abs=1e-12)
    assert s["ratio_mean"].item() == s["ratio_min"].item() == s["ratio_max"].item() == 1.0
    for key in ("clip_frac_low", "clip_frac_high", "dual_clip_frac", "approx_kl"):
        assert s[key].item() == 0.0


def test_importance_weight_cap_masks_tokens_but_keeps_the_denominator() -> None:
    t = torch.tensor
    old = t([[-1.0, -1.0, -1.0]], dtype=F64)
    behav = old - t([[0.0, math.log(10.0), math.log(2.0)]], dtype=F64)  # w = 1, 10, 2
    adv = t([[1.0, 1.0, 1.0]], dtype=F64)
    mask = t([[True, True, True]])
    logp = old.clone().requires_grad_(True)
    loss, s = ppo_policy_loss(
        logp,
        old,
        adv,
        mask,
        eps_low=0.2,
        eps_high=0.2,
        behav_logp_BT=behav,
        behav_imp_weight_cap=5.0,
    )
    assert loss.item() == pytest.approx(-(1.0 + 2.0) / 3)
    assert s["cap_masked_frac"].item() == pytest.approx(1 / 3)
    assert s["imp_weight_max"].item() == pytest.approx(10.0)
    loss.backward()
    assert logp.grad is not None
    assert logp.grad[0].tolist() == pytest.approx([-1 / 3, 0.0, -2 / 3])
    with pytest.raises(ValueError, match="behav_logp_BT"):
        ppo_policy_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.2, behav_imp_weight_cap=5.0)


@pytest.mark.parametrize(
    ("mode", "applied", "kept"),
    [
        ("mask", [1.0, 0.0, 2.0, 0.1], 3),  # w > 5 dropped
        ("truncate", [1.0, 5.0, 2.0, 0.1], 4),  # w > 5 weighs 5
        ("icepop", [1.0, 0.0, 2.0, 0.0], 2),  # w outside [1/5, 5] dropped
    ],
)
def test_behaviour_weight_modes(mode: str, applied: list[float], kept: int) -> None:
    t = torch.tensor
    old = t([[-1.0, -1.0, -1.0, -1.0]], dtype=F64)
    behav = old - t([[0.0, math.log(10.0), math.log(2.0), math.log(0.1)]], dtype=F64)
    adv = t([[1.0, 1.0, 1.0, 1.0]], dtype=F64)
    mask = t([[True, True, True, True]])
    logp = old.clone().requires_grad_(True)
    loss, s = ppo_policy_loss(
        logp,
        old,
        adv,
        mask,
        eps_low=0.2,
        eps_high=0.2,
        behav_logp_BT=behav,
        behav_imp_weight_cap=5.0,
        behav_imp_weight_mode=mode,  # type: ignore[arg-type]
    )
    # on policy (u = 1): each token's loss is -A w_applied, over all four tokens
    assert loss.item() == pytest.approx(-sum(applied) / 4)
    assert s["cap_masked_frac"].item() == pytest.approx(1 - kept / 4)
    assert s["truncated_frac"].item() == pytest.approx(0.25 if mode == "truncate" else 0.0)
    assert s["imp_weight_max"].item() == pytest.approx(10.0)  # w before any correction
    assert s["imp_weight_min"].item() == pytest.approx(0.1)
    loss.backward()
    assert logp.grad is not None
    assert logp.grad[0].tolist() == pytest.approx([-w / 4 for w in applied])


def test_behaviour_weight_settings_are_checked() -> None:
    d = one_token(0.0, 1.0)
    args = (d["logp"], d["old"], d["adv"], d["mask"])
    kw: dict[str, Any] = {"eps_low": 0.2, "eps_high": 0.2, "behav_logp_BT": d["behav"]}
    with pytest.raises(ValueError, match="behav_imp_weight_cap must be > 1"):
        ppo_policy_loss(*args, **kw, behav_imp_weight_cap=1.0)
    with pytest.raises(ValueError, match="'truncate' needs a cap"):
        ppo_policy_loss(*args, **kw, behav_imp_weight_mode="truncate")
    unknown: Any = "clip"
    with pytest.raises(ValueError, match="use mask, truncate or icepop"):
        ppo_policy_loss(*args, **kw, behav_imp_weight_cap=5.0, behav_imp_weight_mode=unknown)


HUGE_W, HUGE_RATIO = (0, 1), [(1, 2, 1.0), (2, 3, -1.0)]
"""A token with prox - behav = 200, and tokens with logp - old = 100 (A > 0: clipped above;
A < 0: dual clipped), where float32's exp overflows (past 88.7)."""


@pytest.mark.parametrize("mode", ["mask", "truncate", "icepop"])
@pytest.mark.parametrize("agg", AGGS)
def test_huge_weight_and_ratio_give_finite_gradients(mode: str, agg: str) -> None:
    """The gradient equals the one where those tokens' log-ratio and weight are harmless and
    their advantage 0 (out of every numerator, in every normalizer); under truncate the
    huge-weight token is kept, weighed c, as one with any other weight above the cap."""
    cap = 5.0
    d = {k: v.float() if v.is_floating_point() else v.clone() for k, v in batch(14).items()}
    d["mask"][1, 2] = d["mask"][2, 3] = True
    b, t = HUGE_W
    d["logp"][b, t], d["adv"][b, t] = d["old"][b, t], 1.0  # unclipped: only w decides
    ref = {k: v.clone() for k, v in d.items()}
    d["behav"][b, t] = d["old"][b, t] - 200.0
    if mode == "truncate":
        ref["behav"][b, t] = d["old"][b, t] - 2 * math.log(cap)  # w = 25: truncated to 5
    else:
        ref["adv"][b, t] = 0.0
    for b, t, a in HUGE_RATIO:
        d["logp"][b, t] = d["old"][b, t] + 100.0
        d["adv"][b, t] = a
        ref["adv"][b, t] = 0.0
    variant = {
        "decoupled": True,
        "behav_imp_weight_cap": cap,
        "behav_imp_weight_mode": mode,
        "dual_clip_c": 3.0,
    }
    loss, s = run_loss(d, variant, agg)
    assert math.isfinite(loss.item())
    assert s["imp_weight_max"].item() == math.inf  # reported as it is, never multiplied
    got, want = grad_of(d, variant, agg), grad_of(ref, variant, agg)
    assert bool(torch.isfinite(got).all())
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert got[1, 2].item() == got[2, 3].item() == 0.0
    assert (got[HUGE_W].item() == 0.0) == (mode != "truncate")
    # and so for the sequence ratio: finite, even though it takes in the huge log-ratios
    logp = d["logp"].clone().requires_grad_(True)
    run_loss({**d, "logp": logp}, {**variant, "level": "sequence"}, agg)[0].backward()
    assert logp.grad is not None
    assert bool(torch.isfinite(logp.grad).all())


@pytest.mark.parametrize("agg", AGGS)
def test_gspo_equals_token_ppo_for_one_token_sequences(agg: str) -> None:
    d = batch(7, B=4, T=5)
    d["mask"] = torch.zeros(4, 5, dtype=torch.bool)
    d["mask"][torch.arange(4), torch.tensor([1, 4, 2, 3])] = True
    for dual in (None, 1.5):
        tok, _ = run_loss(d, {"dual_clip_c": dual}, agg)
        seq, _ = run_loss(d, {"dual_clip_c": dual, "level": "sequence"}, agg)
        assert seq.item() == pytest.approx(tok.item(), abs=1e-14)
    g_tok = grad_of(d, {}, agg)
    g_seq = grad_of(d, {"level": "sequence"}, agg)
    assert torch.allclose(g_tok, g_seq, atol=1e-14)


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("name", ["ppo", "gspo_decoupled"])
def test_packed_row_with_seq_index_equals_padded_rows(name: str, agg: str) -> None:
    d = batch(8, B=3, T=5)
    padded, _ = run_loss(d, VARIANTS[name], agg)
    packed = {k: v.reshape(1, -1) for k, v in d.items()}
    seq_index = torch.arange(3).repeat_interleave(5)[None]
    got, _ = run_loss(packed, VARIANTS[name], agg, seq_index_BT=seq_index)
    assert got.item() == pytest.approx(padded.item(), abs=1e-14)
    seqs = [[(0, i) for i in range(5 * s, 5 * s + 5)] for s in range(3)]
    variant = VARIANTS[name]
    want, _ = ref_policy_loss(
        *(packed[k].tolist() for k in ("logp", "old", "adv", "mask")),
        eps_low=0.1,
        eps_high=0.15,
        behav=packed["behav"].tolist() if variant.get("decoupled") else None,
        cap=variant.get("behav_imp_weight_cap"),
        level=variant.get("level", "token"),
        agg=agg,
        seqs=seqs,
    )
    assert got.item() == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("name", ["ppo", "gspo_decoupled"])
def test_micro_batch_losses_with_global_normalizer_sum_to_full_batch(name: str, agg: str) -> None:
    d = batch(9, B=5, T=6)
    d["mask"][3] = False  # a sequence with no sampled token counts for nothing
    full, _ = run_loss(d, VARIANTS[name], agg)
    g_full = grad_of(d, VARIANTS[name], agg)
    m = d["mask"]
    norm = loss_normalizer(
        agg,  # type: ignore[arg-type]
        num_tokens=int(m.sum()),
        num_seqs=int(m.any(-1).sum()),
    )
    total = torch.zeros((), dtype=F64)
    grads = []
    for rows in (slice(0, 2), slice(2, 3), slice(3, 5)):
        part = {k: v[rows] for k, v in d.items()}
        logp = part["logp"].clone().requires_grad_(True)
        loss, _ = run_loss({**part, "logp": logp}, VARIANTS[name], agg, normalizer=norm)
        loss.backward()
        assert logp.grad is not None
        grads.append(logp.grad)
        total = total + loss.detach()
    assert total.item() == pytest.approx(full.item(), abs=1e-14)
    assert torch.allclose(torch.cat(grads), g_full, atol=1e-14)


def test_aggregate_ignores_masked_inf_and_needs_norm_len() -> None:
    loss = torch.tensor([[1.0, math.inf, 3.0]], dtype=F64)
    mask = torch.tensor([[1, 0, 1]])
    assert aggregate(loss, mask, "token_mean").item() == 2.0
    assert aggregate(loss, mask, "token_sum").item() == 4.0
    assert aggregate(loss, torch.zeros_like(mask), "token_mean").item() == 0.0
    with pytest.raises(ValueError, match="norm_len"):
        aggregate(loss, mask, "seq_mean_token_sum")
    with pytest.raises(ValueError, match="shape"):
        aggregate(loss, mask[:, :2], "token_mean")


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_estimators_match_loop(kind: str) -> None:
    gen = torch.Generator().manual_seed(10)
    logp = -torch.rand(4, 7, generator=gen, dtype=F64) * 4
    ref = -torch.rand(4, 7, generator=gen, dtype=F64) * 4
    got = kl_penalty(logp, ref, kind)  # type: ignore[arg-type]
    for b in range(4):
        for t in range(7):
            d = logp[b, t].item() - ref[b, t].item()
            want = {"k1": d, "k2": d * d / 2, "k3": math.exp(-d) - 1 + d}[kind]
            assert got[b, t].item() == pytest.approx(max(-10.0, min(10.0, want)), abs=1e-12)
    if kind != "k1":
        assert bool((got >= 0).all())


def test_k3_is_nonnegative_and_clamped() -> None:
    d = torch.linspace(-20, 20, 401, dtype=F64)
    k3 = kl_penalty(d, torch.zeros_like(d), "k3")
    assert bool((k3 >= 0).all())
    assert k3.max().item() == 10.0
    assert kl_penalty(torch.zeros(1, dtype=F64), torch.zeros(1, dtype=F64), "k3").item() == 0.0


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_gradient_is_finite_and_zero_past_the_clamp(kind: str) -> None:
    d = [200.0, -200.0, 0.5, -0.5]  # k3 at -200 overflows float32: exp(200) = inf
    logp = torch.tensor([d], dtype=torch.float32, requires_grad=True)
    kl = kl_penalty(logp, torch.zeros_like(logp), kind)  # type: ignore[arg-type]
    k3 = [math.exp(-x) - 1 + x for x in d[2:]]
    want = {"k1": [10.0, -10.0, 0.5, -0.5], "k2": [10.0, 10.0, 0.125, 0.125]}.get(kind)
    assert kl[0].tolist() == pytest.approx(want or [10.0, 10.0, *k3], abs=1e-6)
    kl.sum().backward()
    assert logp.grad is not None
    slope = {"k1": lambda x: 1.0, "k2": lambda x: x, "k3": lambda x: 1 - math.exp(-x)}[kind]
    assert logp.grad[0].tolist() == pytest.approx([0.0, 0.0, slope(0.5), slope(-0.5)], abs=1e-6)


def test_kl_as_a_loss_term_pulls_towards_the_reference() -> None:
    logp = torch.tensor([[-1.0, -2.0]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]], dtype=F64)
    loss = 0.1 * aggregate(kl_penalty(logp, ref, "k3"), torch.ones(1, 2), "token_mean")
    loss.backward()
    assert logp.grad is not None
    # d/dlogp of exp(ref - logp) - 1 + logp - ref is 1 - exp(ref - logp)
    want = [0.1 / 2 * (1 - math.exp(r - lp)) for lp, r in ((-1.0, -1.5), (-2.0, -1.0))]
    assert logp.grad[0].tolist() == pytest.approx(want)


def test_logprob_mismatch_matches_loop() -> None:
    d = batch(15)
    trainer, behav, m = d["old"].float(), d["behav"].float(), d["mask"]
    trainer[0, 1] = behav[0, 1] + 100.0  # exp(100) overflows float32, not the float64 metric
    behav[~m] = -math.inf  # positions off the mask are never read
    got = logprob_mismatch(trainer, behav, m)
    deltas = [
        float(trainer[b, t]) - float(behav[b, t])
        for b in range(m.shape[0])
        for t in range(m.shape[1])
        if m[b, t]
    ]
    assert got["mismatch_abs_mean"].item() == pytest.approx(
        sum(abs(x) for x in deltas) / len(deltas), rel=1e-12
    )
    assert got["mismatch_abs_max"].item() == pytest.approx(max(abs(x) for x in deltas), rel=1e-12)
    want_kl = sum(math.exp(x) - 1 - x for x in deltas) / len(deltas)
    assert got["mismatch_kl"].item() == pytest.approx(want_kl, rel=1e-12)
    assert got["mismatch_abs_max"].item() == pytest.approx(100.0, abs=1e-4)
    empty = logprob_mismatch(trainer, behav, torch.zeros_like(m))
    assert {k: v.item() for k, v in empty.items()} == dict.fromkeys(got, 0.0)
    same = logprob_mismatch(trainer, trainer, m)
    assert {k: v.item() for k, v in same.items()} == dict.fromkeys(got, 0.0)


def test_entropy_matches_loop_and_is_stable() -> None:
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(2, 3, 5, generator=gen, dtype=F64) * 4
    got = entropy_from_logits(logits)
    for b in range(2):
        for t in range(3):
            z = logits[b, t].tolist()
            top = max(z)
            s = sum(math.exp(x - top) for x in z)
            ps = [math.exp(x - top) / s for x in z]
            want = -sum(p * math.log(p) for p in ps)
            assert got[b, t].item() == pytest.approx(want, abs=1e-12)
    huge = torch.tensor([[[1e4, 0.0, -1e4], [3e4, 3e4, 3e4]]], dtype=torch.bfloat16)
    h = entropy_from_logits(huge)
    assert h.dtype == torch.float32
    assert h[0, 0].item() == pytest.approx(0.0, abs=1e-6)
    assert h[0, 1].item() == pytest.approx(math.log(3), abs=1e-6)


@pytest.mark.parametrize("clip", [None, 0.2])
@pytest.mark.parametrize("agg", AGGS)
def test_value_loss_matches_loop(clip: float | None, agg: str) -> None:
    d = batch(12)
    old = d["old"]
    values = old + 0.3 * torch.randn(
        old.shape, generator=torch.Generator().manual_seed(1), dtype=F64
    )
    returns = d["adv"]
    m = d["mask"]
    loss, s = value_loss(values, old, returns, m, value_clip=clip, agg=agg, norm_len=NORM_LEN)  # type: ignore[arg-type]
    per_tok: dict[tuple[int, int], float] = {}
    n_clipped = 0
    for b in range(values.shape[0]):
        for t in range(values.shape[1]):
            if not m[b, t]:
                continue
            v, vo, r = values[b, t].item(), old[b, t].item(), returns[b, t].item()
            l1 = 0.5 * (v - r) ** 2
            if clip is not None:
                l2 = 0.5 * (vo + min(max(v - vo, -clip), clip) - r) ** 2
                n_clipped += l2 > l1
                l1 = max(l1, l2)
            per_tok[b, t] = l1
    rows = [[per_tok[b, t] for t in range(6) if (b, t) in per_tok] for b in range(3)]
    rows = [r for r in rows if r]
    want = {
        "token_mean": sum(per_tok.values()) / len(per_tok),
        "token_sum": sum(per_tok.values()),
        "seq_mean_token_mean": sum(sum(r) / len(r) for r in rows) / len(rows),
        "seq_mean_token_sum": sum(sum(r) / NORM_LEN for r in rows) / len(rows),
    }[agg]
    assert loss.item() == pytest.approx(want, abs=1e-12)
    assert s["value_clip_frac"].item() == pytest.approx(n_clipped / len(per_tok))
    if clip is not None:
        assert n_clipped > 0


def test_empty_mask_gives_zero_loss_and_finite_stats() -> None:
    d = batch(13)
    d["mask"] = torch.zeros_like(d["mask"])
    for variant in VARIANTS.values():
        for agg in AGGS:
            loss, stats = run_loss(d, variant, agg)
            assert loss.item() == 0.0
            assert all(math.isfinite(v.item()) for v in stats.values())


def test_explained_variance_matches_loop() -> None:
    d = batch(21)
    returns, m = d["adv"], d["mask"]
    values = returns + 0.5 * torch.randn(
        returns.shape, generator=torch.Generator().manual_seed(3), dtype=F64
    )
    pairs = [
        (values[b, t].item(), returns[b, t].item())
        for b in range(returns.shape[0])
        for t in range(returns.shape[1])
        if m[b, t]
    ]
    n = len(pairs)
    r_mean = sum(r for _, r in pairs) / n
    var_r = sum((r - r_mean) ** 2 for _, r in pairs) / n
    d_mean = sum(r - v for v, r in pairs) / n
    var_d = sum((r - v - d_mean) ** 2 for v, r in pairs) / n
    got = explained_variance(values, returns, m)
    assert got.item() == pytest.approx(1 - var_d / var_r, abs=1e-12)
    assert 0 < got.item() < 1  # a noisy but informative critic
    # a perfect critic explains everything; a constant one nothing; constant returns give 0
    assert explained_variance(returns, returns, m).item() == pytest.approx(1.0)
    assert explained_variance(torch.full_like(returns, 3.0), returns, m).item() == pytest.approx(
        0.0, abs=1e-12
    )
    assert explained_variance(values, torch.ones_like(returns), m).item() == 0.0
    assert explained_variance(values, returns, torch.zeros_like(m)).item() == 0.0
