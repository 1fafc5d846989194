"""Every algorithm knob acts, and the real trainer's step matches an independent float64 reference.

For each knob, on hand-built trajectories where it binds: (a) changing it changes the real
trainer's parameter update by far more than the tolerance, (b) the real trainer's update matches
`tests.support.reference.reference_step`, and a stat of the real step shows the knob bind.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from store.types import Trajectory
from tests.support.knobs import (
    ACTS_MIN,
    MIXED,
    STAT_ATOL,
    STAT_RTOL,
    UNTRAINABLE_IN_SAMPLED,
    Result,
    Setup,
    assert_matches_reference,
    relative,
    result,
    setup,
)

pytestmark = pytest.mark.slow

# -- the knobs -----------------------------------------------------------------------------------

Binds = Callable[[Result, Result], bool]


@dataclass(frozen=True)
class Case:
    id: str
    on: Setup
    off: Setup
    binds: Binds
    """Where a stat of the real step (`on`, against `off`) shows that the knob binds."""


def stat_above(key: str, floor: float = 0.0) -> Binds:
    return lambda on, off: on.stats[key] > floor


def stat_grows(key: str) -> Binds:
    return lambda on, off: on.stats[key] > off.stats.get(key, 0.0)


def shaped(on: Result, off: Result) -> bool:
    """Overlong shaping lowered some rewards of the step (and only under `on`'s settings)."""
    raw = [t.reward for t in on.update.built.used]
    return any(a < b - 1e-9 for a, b in zip(on.update.built.rewards, raw, strict=True)) and (
        on.update.built.rewards != off.update.built.rewards
    )


def dropped_groups(on: Result, off: Result) -> bool:
    return {t.session.group_id for t in on.update.built.dropped} == {
        "c",
        None,
    } and not off.update.built.dropped


def cut_unrewarded(on: Result, off: Result) -> bool:
    """The four cut turns are counted either way; only `on` takes their rewards (three of
    them had one), so its trained rewards sum to less."""
    got, raw = on.update.built, off.update.built
    return (
        got.truncated_turns == raw.truncated_turns == 4
        and sum(got.rewards) < sum(raw.rewards) - 1.0
    )


def lone_advantage(nonzero: bool) -> Binds:
    """The ungrouped trajectory's raw advantage is 0 under a baseline, not under none."""

    def check(on: Result, off: Result) -> bool:
        built = on.update.built
        lone = [i for i, t in enumerate(built.used) if t.session.group_id is None]
        assert len(lone) == 1
        seq = built.sequences[_first_sequence(built.used, lone[0])]
        values = [a for a, m in zip(seq.advantages, seq.loss_mask, strict=True) if m]
        return all(v != 0 for v in values) if nonzero else all(v == 0 for v in values)

    return check


def _first_sequence(used: list[Trajectory], index: int) -> int:
    return sum(sum(1 for s in t.segments if any(s.loss_mask)) for t in used[:index])


def untrainable(on: Result, off: Result) -> bool:
    return (
        on.update.built.untrainable_turns == UNTRAINABLE_IN_SAMPLED
        and off.update.built.untrainable_turns == 0
    )


def left_out(on: Result, off: Result) -> bool:
    """The episode of one untrainable turn gives no sequence: it is dropped, and counted."""
    return (
        len(on.update.built.dropped) == 1
        and on.update.built.untrainable_turns == 1
        and not off.update.built.dropped
    )


def minibatches(n: int) -> Binds:
    return lambda on, off: on.stats["minibatches"] == n


def on_policy_ratio(on: Result, off: Result) -> bool:
    """One mini-batch trains on the proximal policy itself: every ratio is 1."""
    return on.stats["ratio_min"] == pytest.approx(1.0, abs=1e-5) and on.stats[
        "ratio_max"
    ] == pytest.approx(1.0, abs=1e-5)


def more_steps(on: Result, off: Result) -> bool:
    return (
        len(on.ref.losses) == 2 * len(off.ref.losses)
        and on.stats["ratio_max"] > off.stats["ratio_max"]
    )


def always(on: Result, off: Result) -> bool:
    return True


def bounded_advantages(on: Result, off: Result) -> bool:
    """No turn's raw advantage is outsized (a group's z-scores stay within sqrt(n - 1)), and the
    uniform group's turns get exactly 0 (never 1 / eps)."""
    built = on.update.built
    raw = [abs(a) for seq in built.sequences for a in seq.advantages]
    uniform = [
        a
        for t, seq in zip(built.used, built.sequences, strict=False)
        if t.session.group_id == "u"
        for a in seq.advantages
    ]
    return max(raw) < 3.0 and all(a == 0.0 for a in uniform)


WITH_UNTRAINABLE_TURNS: dict[str, dict[str, Any]] = {
    "kl-reward": {"kl_coef": 0.5, "kl_placement": "reward"},
    "kl-loss": {"kl_coef": 1.0, "kl_kind": "k2"},
    "sequence": {"importance_level": "sequence"},
    "entropy": {"entropy_coef": 1.0},
}
"""Knobs whose math runs over the trained tokens only, on the input with untrainable turns."""

NO_CLIP = {"grad_clip": 0.0}
"""For the aggregations: with the global-norm clip binding (it does at 1.0 here), a loss scaled
by a constant gives the same update."""

CASES = [
    # the PPO clip, against the proximal policy (moved away from it by earlier mini-batches) and,
    # not decoupled, against the behaviour policy
    Case("eps_low", setup(eps_low=0.1), setup(), stat_grows("clip_frac_low")),
    Case(
        "eps_low-coupled",
        setup(eps_low=0.1, decoupled=False),
        setup(decoupled=False),
        stat_grows("clip_frac_low"),
    ),
    Case("eps_high", setup(eps_high=0.1), setup(), stat_grows("clip_frac_high")),
    Case(
        "eps_high-coupled",
        setup(eps_high=0.1, decoupled=False),
        setup(decoupled=False),
        stat_grows("clip_frac_high"),
    ),
    Case(
        "dual_clip_c",
        setup("far", dual_clip_c=2.0, decoupled=False),
        setup("far", decoupled=False),
        stat_above("dual_clip_frac"),
    ),
    Case(
        "dual_clip_c-decoupled",
        setup("far", dual_clip_c=1.5, behav_imp_weight_cap=None),
        setup("far", behav_imp_weight_cap=None),
        stat_above("dual_clip_frac"),
    ),
    # sequence-level ratio (GSPO)
    Case(
        "importance_level-sequence",
        setup(importance_level="sequence"),
        setup(),
        lambda on, off: on.stats["ratio_max"] < off.stats["ratio_max"],
    ),
    Case(
        "importance_level-sequence-clip",
        setup(importance_level="sequence", eps_low=0.02, eps_high=0.02),
        setup(importance_level="sequence"),
        lambda on, off: on.stats["clip_frac_low"] + on.stats["clip_frac_high"] > 0,
    ),
    Case(
        "importance_level-token",
        setup(importance_level="token", eps_low=0.02, eps_high=0.02),
        setup(importance_level="sequence", eps_low=0.02, eps_high=0.02),
        stat_grows("clip_frac_high"),
    ),
    # aggregation, each against one that weighs tokens differently
    *(
        Case(
            f"agg-{agg}-vs-{other}",
            setup(agg=agg, optim=NO_CLIP),
            setup(agg=other, optim=NO_CLIP),
            always,
        )
        for agg, other in [
            ("token_mean", "seq_mean_token_mean"),
            ("seq_mean_token_mean", "token_mean"),
            ("seq_mean_token_sum", "seq_mean_token_mean"),
            ("token_sum", "token_mean"),
        ]
    ),
    # KL to the reference, in the loss and in the reward
    *(
        Case(
            f"kl-{placement}-{kind}",
            setup(kl_coef=coef, kl_kind=kind, kl_placement=placement),
            setup(),
            stat_above("kl_ref") if kind != "k1" else lambda on, off: on.stats["kl_ref"] != 0,
        )
        for placement, coef in [("loss", 1.0), ("reward", 0.5)]
        for kind in ["k1", "k2", "k3"]
    ),
    # the run's per-turn discount: the returns, and the KL reward-to-go between turns
    Case(
        "discount-kl-reward",
        setup("multiturn_discounted", kl_coef=0.5, kl_placement="reward", kl_kind="k1"),
        setup("multiturn", kl_coef=0.5, kl_placement="reward", kl_kind="k1"),
        always,
    ),
    Case("entropy_coef", setup(entropy_coef=1.0), setup(), stat_above("entropy")),
    # DAPO shaping and filtering
    Case("overlong_buffer", setup(overlong_buffer=8), setup(), shaped),
    Case(
        "overlong_penalty_factor",
        setup(overlong_buffer=8, overlong_penalty_factor=0.25),
        setup(overlong_buffer=8),
        shaped,
    ),
    Case(
        "zero_truncated_reward",
        setup("cut_turns", zero_truncated_reward=True),
        setup("cut_turns"),
        cut_unrewarded,
    ),
    Case(
        "dynamic_sampling",
        setup("uniform", dynamic_sampling=True),
        setup("uniform"),
        dropped_groups,
    ),
    # decoupled PPO and its importance-weight cap
    Case(
        "behav_imp_weight_cap",
        setup("far", behav_imp_weight_cap=5.0),
        setup("far", behav_imp_weight_cap=None),
        stat_above("cap_masked_frac"),
    ),
    Case(
        "behav_imp_weight_cap-low",
        setup(behav_imp_weight_cap=1.5),
        setup(),
        stat_above("cap_masked_frac"),
    ),
    # the cap's mode: truncate (TIS) keeps the tokens mask (MIS, the default) drops, at weight
    # cap; icepop drops those with a weight below 1 / cap too
    Case(
        "behav_imp_weight_mode-truncate",
        setup("far", behav_imp_weight_mode="truncate"),
        setup("far"),
        lambda on, off: (
            on.stats["truncated_frac"] > 0
            and on.stats["cap_masked_frac"] == 0
            and off.stats["cap_masked_frac"] > 0
            and math.isclose(
                on.stats["truncated_frac"],
                on.ref.stats["truncated_frac"],
                rel_tol=STAT_RTOL,
                abs_tol=STAT_ATOL,
            )
        ),
    ),
    Case(
        "behav_imp_weight_mode-truncate-vs-uncapped",
        setup("far", behav_imp_weight_mode="truncate"),
        setup("far", behav_imp_weight_cap=None),
        lambda on, off: on.stats["truncated_frac"] > 0 and off.stats["truncated_frac"] == 0,
    ),
    Case(
        "behav_imp_weight_mode-icepop",
        setup("far", behav_imp_weight_cap=2.0, behav_imp_weight_mode="icepop"),
        setup("far", behav_imp_weight_cap=2.0),
        stat_grows("cap_masked_frac"),
    ),
    Case(
        "behav_imp_weight_mode-icepop-low",
        setup(behav_imp_weight_cap=1.5, behav_imp_weight_mode="icepop"),
        setup(behav_imp_weight_cap=1.5),
        stat_grows("cap_masked_frac"),
    ),
    Case(
        "decoupled",
        setup(decoupled=True),
        setup(decoupled=False),
        stat_above("imp_weight_max", 1.0),
    ),
    Case(
        "decoupled-far",
        setup("far", decoupled=True),
        setup("far", decoupled=False),
        stat_above("imp_weight_max", 1.0),
    ),
    # the update schedule
    Case("ppo_n_minibatches-1", setup(ppo_n_minibatches=1), setup(), on_policy_ratio),
    Case("ppo_n_minibatches-2", setup(ppo_n_minibatches=2), setup(), minibatches(2)),
    Case(
        "ppo_n_minibatches-4",
        setup(ppo_n_minibatches=4),
        setup(ppo_n_minibatches=2),
        minibatches(4),
    ),
    Case(
        "ppo_n_minibatches-16",
        setup(ppo_n_minibatches=16),
        setup(),
        minibatches(sum(1 for e in MIXED for _ in e.segments)),
    ),
    Case(
        "ppo_minibatch_split-prefixes",
        setup("shared_prompts", ppo_n_minibatches=2, ppo_minibatch_split="prefixes"),
        setup("shared_prompts", ppo_n_minibatches=2),
        lambda on, off: (
            sorted(on.ref.minibatches) == [[0, 2, 4], [1, 3, 5]]
            and sorted(off.ref.minibatches) != [[0, 2, 4], [1, 3, 5]]
        ),
    ),
    Case(  # the backend packs trees: auto keeps the groups whole, and the step is the flat one
        "ppo_minibatch_split-auto-prefix_sharing",
        setup("shared_prompts", backend={"prefix_sharing": True}, ppo_n_minibatches=2),
        setup("shared_prompts", ppo_n_minibatches=2),
        lambda on, off: sorted(on.ref.minibatches) == [[0, 2, 4], [1, 3, 5]],
    ),
    Case("ppo_epochs-2", setup(ppo_epochs=2), setup(), more_steps),
    Case(
        "ppo_epochs-2-one-minibatch",
        setup(ppo_epochs=2, ppo_n_minibatches=1),
        setup(ppo_n_minibatches=1),
        lambda on, off: on.stats["ratio_max"] > 1.0,
    ),
    # group baselines (groups of 4, 3 and 1)
    Case(
        "group_baseline-mean_std",
        setup(group_baseline="mean_std"),
        setup(group_baseline="none"),
        lone_advantage(False),
    ),
    Case(
        "group_baseline-mean",
        setup(group_baseline="mean"),
        setup(group_baseline="mean_std"),
        lone_advantage(False),
    ),
    Case(
        "group_baseline-leave_one_out",
        setup(group_baseline="leave_one_out"),
        setup(group_baseline="mean"),
        lone_advantage(False),
    ),
    Case(
        "group_baseline-none",
        setup(group_baseline="none"),
        setup(group_baseline="mean"),
        lone_advantage(True),
    ),
    # multi-turn credit: per-turn rewards, discount < 1, uniform and near-uniform groups beside a
    # single-turn group (the reference takes each turn position's statistics on its own)
    *(
        Case(
            f"multiturn-{mode}",
            setup("multiturn_discounted", group_baseline=mode),
            setup("multiturn_discounted", group_baseline="none"),
            bounded_advantages,
        )
        for mode in ("mean_std", "mean", "leave_one_out")
    ),
    Case(
        "discount",
        setup("multiturn_discounted", group_baseline="mean"),
        setup("multiturn", group_baseline="mean"),
        bounded_advantages,
    ),
    # on raw returns: a group baseline leaves advantages of mean 0 in every group, so batch
    # normalisation only rescales them, which Adam's step hardly sees
    Case(
        "adv_norm-none",
        setup(adv_norm="none", group_baseline="none"),
        setup(group_baseline="none"),
        always,
    ),
    # per-turn sampling settings: temperatures, and turns the trainer cannot reproduce
    Case("turn_sampling", setup("sampled"), setup("sampled_plain"), untrainable),
    Case(
        "turn_sampling-context-only",
        setup("context_only", ppo_n_minibatches=2),
        setup("context_only_plain", ppo_n_minibatches=2),
        left_out,
    ),
    Case(
        "turn_sampling-seq_mean_token_mean",
        setup("sampled", agg="seq_mean_token_mean", optim=NO_CLIP),
        setup("sampled", agg="token_sum", optim=NO_CLIP),
        always,
    ),
    *(
        Case(f"turn_sampling-{name}", setup("sampled", **algo), setup("sampled"), always)
        for name, algo in WITH_UNTRAINABLE_TURNS.items()
    ),
    Case("temperature", replace(setup(), temperature=0.7), setup(), always),
    # the optimizer's own settings
    Case("weight_decay", setup(optim={"weight_decay": 0.5}), setup(), always),
    Case(
        "grad_clip-off", setup(optim=NO_CLIP), setup(), lambda on, off: on.stats["grad_norm"] > 1.0
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_knob_changes_the_update_and_matches_the_reference(case: Case, tiny_model: Path) -> None:
    on, off = result(case.on, tiny_model), result(case.off, tiny_model)
    assert_matches_reference(on)
    assert_matches_reference(off)
    acts = relative(on.delta, off.delta)
    print(f"{case.id}: acts {acts:.3g}, error on {on.error:.2g}, off {off.error:.2g}")
    assert acts > ACTS_MIN, f"{case.id}: the update moved by only {acts:.3g}"
    assert case.binds(on, off), f"{case.id} does not bind: {on.stats}"
