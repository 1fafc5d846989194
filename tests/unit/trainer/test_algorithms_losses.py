"""The policy loss (every variant and aggregation) against independent float64 references written
as plain Python loops."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from tests.support.losses import AGGS, F64, VARIANTS, batch, ref_policy_loss, run_loss
from trainer.algorithms import (
    aggregate,
    loss_normalizer,
    ppo_policy_loss,
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
