"""The harness of the knob tests (tests/integration/trainer/test_knobs.py): hand-built trajectories
where each knob binds, and one training step taken by the real trainer and by the independent
float64 reference (`tests.support.reference.reference_step`) on the same inputs."""

from __future__ import annotations

import asyncio
import math
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import torch

from rlgateway.build import build_trainer
from store import Store
from store.types import Segment, SessionInfo, SessionStatus, TrainState, Trajectory
from tests.support.reference import ReferenceStep, initial_logprobs, reference_step
from trainer.backends.fsdp import FSDPBackend
from trainer.config import TrainConfig
from trainer.loop import Update

# -- inputs ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Turn:
    """A sampled turn: `n` tokens, the turn's own reward, its sampling settings, and the offset
    of its behaviour logprobs from the initial policy's (per token: `offset + noise * N(0,1)`)."""

    n: int
    reward: float = 0.0
    sampling: dict[str, Any] | None = None
    offset: float = 0.0
    cut: bool = False
    """`max_tokens` cut it (finish reason `length`)."""


@dataclass(frozen=True)
class Context:
    """Prompt, tool or user tokens: `n` tokens that are not trained; every context of one `key`
    the same tokens (a prompt the members of a group share)."""

    n: int
    key: str | None = None


Part = Turn | Context


@dataclass(frozen=True)
class Episode:
    group: str | None
    segments: tuple[tuple[Part, ...], ...]
    final_reward: float = 0.0


def claimed_session(sid: str, group: str | None) -> SessionInfo:
    """An ended session's info, claimed by the trainer: what a hand-built trajectory holds."""
    now = datetime(2025, 1, 1, tzinfo=UTC)
    return SessionInfo(
        id=sid,
        run_id="run",
        group_id=group,
        metadata={},
        status=SessionStatus.ENDED,
        created_at=now,
        ended_at=now,
        prefix_breaks=0,
        train_state=TrainState.CLAIMED,
    )


def build_trajectories(
    episodes: list[Episode],
    model_dir: Path,
    *,
    seed: int = 0,
    noise: float = 0.3,
    run_temperature: float = 1.0,
    discount: float = 1.0,
) -> list[Trajectory]:
    """Trajectories of random byte tokens whose behaviour logprobs are the initial policy's
    (at each turn's temperature) plus each turn's offset and Gaussian noise. Returns are the
    store's: G_i = r_i + discount * G_{i+1}, the final reward on the last turn."""
    gen = torch.Generator().manual_seed(seed)
    keyed: dict[str, list[int]] = {}
    drafts: list[dict[str, Any]] = []
    for e, ep in enumerate(episodes):
        segs = []
        for s, parts in enumerate(ep.segments):
            tokens: list[int] = []
            mask: list[int] = []
            spans: list[tuple[int, int]] = []
            sampling: list[dict[str, Any]] = []
            temps: list[float] = []
            offsets: list[float] = []
            turns: list[Turn] = []
            for part in parts:
                start = len(tokens)
                key = part.key if isinstance(part, Context) else None
                if key is not None and key in keyed:
                    tokens += keyed[key]
                else:
                    tokens += torch.randint(0, 256, (part.n,), generator=gen).tolist()
                    if key is not None:
                        keyed[key] = tokens[start:]
                sampled = isinstance(part, Turn)
                mask += [int(sampled)] * part.n
                if isinstance(part, Turn):
                    spans.append((start, start + part.n))
                    sampling.append(dict(part.sampling or {}))
                    t = (part.sampling or {}).get("temperature") or run_temperature
                    temps += [float(t)] * part.n
                    offsets += (part.offset + noise * torch.randn(part.n, generator=gen)).tolist()
                    turns.append(part)
                else:
                    temps += [run_temperature] * part.n
                    offsets += [0.0] * part.n
            assert mask[0] == 0, "a segment starts with context"
            segs.append(
                {
                    "tokens": tokens,
                    "mask": mask,
                    "spans": spans,
                    "sampling": sampling,
                    "temps": temps,
                    "offsets": offsets,
                    "turns": turns,
                    "cids": [f"c{e}-{s}-{k}" for k in range(len(spans))],
                }
            )
        drafts.append({"episode": ep, "segments": segs})

    flat = [seg for d in drafts for seg in d["segments"]]
    logps = initial_logprobs(
        model_dir,
        [seg["tokens"] for seg in flat],
        [torch.tensor(seg["temps"], dtype=torch.float64) for seg in flat],
    )
    for seg, logp in zip(flat, logps, strict=True):
        seg["logp"] = logp.tolist()

    out = []
    for e, d in enumerate(drafts):
        ep = d["episode"]
        segments = []
        turn_rewards: list[tuple[str, float]] = []
        finish: dict[str, str] = {}
        for s, seg in enumerate(d["segments"]):
            behav = [
                (lp + off) if m else 0.0
                for lp, off, m in zip(seg["logp"], seg["offsets"], seg["mask"], strict=True)
            ]
            segments.append(
                Segment(
                    id=f"seg{e}-{s}",
                    index=s,
                    tokens=seg["tokens"],
                    loss_mask=seg["mask"],
                    logprobs=behav,
                    versions=[0 if m else -1 for m in seg["mask"]],
                    completion_ids=seg["cids"],
                    turn_spans=seg["spans"],
                    turn_sampling=seg["sampling"],
                )
            )
            turn_rewards += [(c, t.reward) for c, t in zip(seg["cids"], seg["turns"], strict=True)]
            finish |= {
                c: "length" if t.cut else "stop"
                for c, t in zip(seg["cids"], seg["turns"], strict=True)
            }
        returns: dict[str, float] = {}
        running, last = 0.0, True
        for cid, r in reversed(turn_rewards):
            running = r + (ep.final_reward if last else 0.0) + discount * running
            last = False
            returns[cid] = running
        returns = dict(reversed(returns.items()))
        total = ep.final_reward + sum(r for _, r in turn_rewards)
        per_turn = dict(turn_rewards)
        per_turn[turn_rewards[-1][0]] += ep.final_reward
        out.append(
            Trajectory(
                session=claimed_session(f"sess{e}", ep.group),
                segments=segments,
                returns=returns,
                reward=total,
                min_version=0,
                turn_rewards=per_turn,
                finish_reasons=finish,
            )
        )
    return out


P = Context

MIXED = [
    # group a: four single-turn episodes of different lengths
    Episode("a", ((P(6), Turn(10)),), final_reward=1.0),
    Episode("a", ((P(6), Turn(14)),), final_reward=0.0),
    Episode("a", ((P(5), Turn(8)),), final_reward=0.5),
    Episode("a", ((P(7), Turn(12)),), final_reward=0.2),
    # group b (three: LOO's n / (n - 1) differs from group a's): a two-turn episode with a turn
    # reward, and one whose second segment began after a prefix break
    Episode("b", ((P(6), Turn(6, reward=0.3), P(4), Turn(7)),), final_reward=0.5),
    Episode("b", ((P(6), Turn(9)),), final_reward=0.9),
    Episode("b", ((P(6), Turn(5)), (P(8), Turn(6))), final_reward=-0.4),
    # alone: advantage 0 under every baseline but none
    Episode(None, ((P(6), Turn(9)),), final_reward=0.7),
]

UNIFORM = [
    *MIXED,
    Episode("c", ((P(6), Turn(7)),), final_reward=0.5),
    Episode("c", ((P(6), Turn(11)),), final_reward=0.5),
    Episode("c", ((P(6), Turn(9)),), final_reward=0.5),
]


def _sampled(plain: bool) -> list[Episode]:
    """Turns at their own temperatures, and one turn of each kind the trainer cannot reproduce
    (each beside a trainable turn of its segment); `plain`: the same without settings."""

    def t(n: int, reward: float = 0.0, **sampling: Any) -> Turn:
        return Turn(n, reward=reward, sampling=None if plain else sampling)

    return [
        Episode("a", ((P(6), t(10, temperature=0.7)),), final_reward=1.0),
        Episode("a", ((P(6), t(12, temperature=1.4)),), final_reward=0.0),
        Episode("a", ((P(5), t(6, top_p=0.9), P(3), t(7, temperature=0.7)),), final_reward=0.5),
        Episode("a", ((P(5), t(5, temperature=0.0), P(3), t(8)),), final_reward=0.2),
        Episode("b", ((P(6), t(6, top_k=5), P(4), t(7, 0.3, temperature=0.8)),), final_reward=0.5),
        Episode("b", ((P(6), t(4, min_p=0.05), P(2), t(9, temperature=1.2)),), final_reward=0.9),
        Episode("b", ((P(6), t(5, min_new_tokens=3), P(2), t(6)),), final_reward=-0.4),
    ]


def _context_only(plain: bool) -> list[Episode]:
    """An episode whose only turn the trainer cannot reproduce: its segment trains nothing."""
    top_p = None if plain else {"top_p": 0.5}
    return [
        Episode("a", ((P(6), Turn(10)),), final_reward=1.0),
        Episode("a", ((P(6), Turn(12, sampling=top_p)),), final_reward=0.0),
        Episode("a", ((P(6), Turn(8)),), final_reward=0.3),
        Episode("b", ((P(6), Turn(9)),), final_reward=0.3),
        Episode("b", ((P(6), Turn(7)),), final_reward=0.8),
    ]


MULTI_TURN = [
    # group m: three-turn episodes with per-turn rewards and a final one, and a two-turn one
    Episode("m", ((P(5), Turn(6, reward=0.2), P(3), Turn(5, reward=0.1), P(3), Turn(7)),), 1.0),
    Episode("m", ((P(5), Turn(8, reward=0.2), P(3), Turn(6), P(3), Turn(5)),), 0.0),
    Episode("m", ((P(5), Turn(7), P(3), Turn(6, reward=0.3)),), 0.5),
    # group u: uniform (every member's every turn the same), where the episode-return std is 0
    Episode("u", ((P(5), Turn(6, reward=1.0), P(3), Turn(6, reward=1.0), P(3), Turn(6)),), 1.0),
    Episode("u", ((P(5), Turn(7, reward=1.0), P(3), Turn(5, reward=1.0), P(3), Turn(8)),), 1.0),
    # group n: near-uniform
    Episode("n", ((P(5), Turn(6), P(3), Turn(6)),), 1.0),
    Episode("n", ((P(5), Turn(5), P(3), Turn(7)),), 1.0 - 1e-4),
    # single-turn group s beside them
    Episode("s", ((P(6), Turn(9)),), 1.0),
    Episode("s", ((P(6), Turn(8)),), 0.0),
]
"""Multi-turn groups (per-turn rewards, uniform, near-uniform) in one batch with a single-turn
group."""

CUT_TURNS = [
    # group m: turns max_tokens cut (`cut`), rewarded by their grader: a cut first turn with a
    # turn reward, a cut last turn carrying the final reward, and a cut turn that earned nothing
    Episode("m", ((P(5), Turn(6, reward=1.0, cut=True), P(3), Turn(5)),), 0.5),
    Episode("m", ((P(5), Turn(8), P(3), Turn(6, cut=True)),), 1.0),
    Episode("m", ((P(5), Turn(7, cut=True), P(3), Turn(6, reward=0.3)),), 0.0),
    Episode("m", ((P(5), Turn(6), P(3), Turn(7)),), 0.2),
    # group s: single turns, a cut one graded right among them
    Episode("s", ((P(6), Turn(9, cut=True)),), 1.0),
    Episode("s", ((P(6), Turn(8)),), 1.0),
    Episode("s", ((P(6), Turn(7)),), 0.0),
]
"""Turns `max_tokens` cut, graded as if whole (`zero_truncated_reward` takes their rewards)."""

SHARED_PROMPTS = [
    # groups a and b, each answering one 20-token prompt (shared: trainer.prefix.prefix_units)
    Episode("a", ((P(20, "a"), Turn(10)),), final_reward=1.0),
    Episode("b", ((P(20, "b"), Turn(9)),), final_reward=0.9),
    Episode("a", ((P(20, "a"), Turn(14)),), final_reward=0.0),
    Episode("b", ((P(20, "b"), Turn(5)),), final_reward=-0.4),
    Episode("a", ((P(20, "a"), Turn(8)),), final_reward=0.5),
    Episode("b", ((P(20, "b"), Turn(12)),), final_reward=0.3),
]

INPUTS: dict[str, tuple[list[Episode], float]] = {
    "mixed": (MIXED, 0.3),
    "far": (MIXED, 1.0),
    "uniform": (UNIFORM, 0.3),
    "sampled": (_sampled(plain=False), 0.3),
    "sampled_plain": (_sampled(plain=True), 0.3),
    "context_only": (_context_only(plain=False), 0.3),
    "context_only_plain": (_context_only(plain=True), 0.3),
    "multiturn": (MULTI_TURN, 0.3),
    "multiturn_discounted": (MULTI_TURN, 0.3),
    "cut_turns": (CUT_TURNS, 0.3),
    "shared_prompts": (SHARED_PROMPTS, 0.3),
}
DISCOUNTS = {"multiturn_discounted": 0.5, "cut_turns": 0.5}
"""The run's per-turn discount for an input (1 for the others): its returns are built with it."""
"""name -> (episodes, behaviour noise). "far": behaviour logprobs spread far from the initial
policy's (importance weights beyond the cap, ratios beyond the dual clip)."""
UNTRAINABLE_IN_SAMPLED = 5

# -- one step, real and reference ----------------------------------------------------------------

LR = 1e-3
ADAM_EPS = 1e-3
"""Both optimizers' eps: with 1e-8 an early Adam step is ~lr * sign(g), and a float32 gradient
element near 0 may flip its sign against the float64 one."""
TOKEN_BUDGET = 32
"""Small enough that most mini-batches span several packed micro-batches."""
MATCH_RTOL = 1e-4
"""||d_real - d_ref|| / ||d_ref|| of the parameter updates (measured: 2e-6 to 2e-5)."""
ACTS_MIN = 0.05
"""||d_on - d_off|| / ||d_off|| a knob must at least move the update by."""
STAT_RTOL, STAT_ATOL = 1e-4, 1e-6
COMPARED_STATS = (
    "clip_frac_low",
    "clip_frac_high",
    "dual_clip_frac",
    "cap_masked_frac",
    "entropy",
    "kl_ref",
    "ratio_min",
    "ratio_max",
    "imp_weight_min",
    "imp_weight_max",
)

Items = tuple[tuple[str, Any], ...]


@dataclass(frozen=True)
class Setup:
    """One step's configuration (hashable, so each runs once per module)."""

    algo: Items = ()
    inputs: str = "mixed"
    optim: Items = ()
    algorithm: str = "grpo"
    max_tokens: int | None = 16
    temperature: float = 1.0
    backend: Items = ()

    def config(self, checkpoint_dir: str = "unused") -> TrainConfig:
        return TrainConfig.model_validate(
            {
                "run": "knobs",
                "database_url": "sqlite:///unused",
                "checkpoint_dir": checkpoint_dir,
                "tensorboard": False,
                "algorithm": self.algorithm,
                "algo": dict(self.algo),
                "optim": {"lr": LR, **dict(self.optim)},
                "max_tokens": self.max_tokens,
                "temperature": self.temperature,
                "discount": DISCOUNTS.get(self.inputs, 1.0),
                "token_budget": TOKEN_BUDGET,
                "backend": {"type": "fsdp", **dict(self.backend)},
            }
        )


def setup(
    inputs: str = "mixed",
    optim: dict[str, Any] | None = None,
    backend: dict[str, Any] | None = None,
    **algo: Any,
) -> Setup:
    return Setup(
        tuple(sorted(algo.items())),
        inputs,
        tuple(sorted((optim or {}).items())),
        backend=tuple(sorted((backend or {}).items())),
    )


@dataclass
class Result:
    setup: Setup
    trajectories: list[Trajectory]
    update: Update
    delta: torch.Tensor
    """The real trainer's parameter update, float64, flattened in sorted key order."""
    ref: ReferenceStep

    @property
    def stats(self) -> dict[str, float]:
        return self.update.stats

    @property
    def error(self) -> float:
        return relative(self.delta, self.ref.update_vector())


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


_INPUTS: dict[str, list[Trajectory]] = {}
_RESULTS: dict[Setup, Result] = {}


def trajectories(name: str, model_dir: Path) -> list[Trajectory]:
    if name not in _INPUTS:
        episodes, noise = INPUTS[name]
        _INPUTS[name] = build_trajectories(
            episodes, model_dir, noise=noise, discount=DISCOUNTS.get(name, 1.0)
        )
    return _INPUTS[name]


async def real_update(
    cfg: TrainConfig, trajs: list[Trajectory], model_dir: Path
) -> tuple[Update, dict[str, torch.Tensor]]:
    """`Trainer.update` of a fresh trainer (`build_trainer`), with Adam's eps at ADAM_EPS."""
    with tempfile.TemporaryDirectory() as d:
        cfg = cfg.model_copy(update={"checkpoint_dir": d})
        store = await Store.connect(f"sqlite:///{d}/store.db")
        try:
            trainer = await build_trainer(cfg, store, None, model_dir)
            try:
                assert isinstance(trainer.backend, FSDPBackend)
                for group in trainer.backend.optimizer.param_groups:
                    group["eps"] = ADAM_EPS
                update = await trainer.update(trajs)
                return update, trainer.backend.full_state_dict()
            finally:
                trainer.close()
        finally:
            await store.close()


def result(s: Setup, model_dir: Path) -> Result:
    if s not in _RESULTS:
        trajs = trajectories(s.inputs, model_dir)
        cfg = s.config()
        ref = reference_step(trajs, cfg, model_dir, adam_eps=ADAM_EPS)
        update, state = asyncio.run(real_update(cfg, trajs, model_dir))
        assert state.keys() == ref.state.keys()
        delta = torch.cat([(state[k].double() - ref.initial[k]).flatten() for k in sorted(state)])
        _RESULTS[s] = Result(s, trajs, update, delta, ref)
    return _RESULTS[s]


def assert_matches_reference(r: Result) -> None:
    """The real step did what the reference did: the same sequences, masks, temperatures and
    advantages, the same trajectories used and dropped, the same stats and parameter update."""
    ref, built, update = r.ref, r.update.built, r.update
    name = r.setup
    ids = [t.session.id for t in r.trajectories]
    assert [t.session.id for t in built.used] == [ids[i] for i in ref.kept], name
    assert sorted(t.session.id for t in built.dropped) == sorted(ids[i] for i in ref.dropped)
    assert built.untrainable_turns == ref.untrainable_turns, name
    assert built.rewards == pytest.approx([ref.shaped_rewards[i] for i in ref.kept], abs=1e-12)
    assert len(update.sequences) == len(ref.sequences), name
    for raw, seq, want in zip(built.sequences, update.sequences, ref.sequences, strict=True):
        assert seq.tokens == want.tokens
        assert seq.loss_mask == want.mask_T.long().tolist(), name
        temps = seq.temperatures or [r.setup.temperature] * len(seq)
        torch.testing.assert_close(
            torch.tensor(temps, dtype=torch.float64)[want.mask_T], want.temp_T[want.mask_T]
        )
        torch.testing.assert_close(
            torch.tensor(raw.advantages, dtype=torch.float64), want.raw_adv_T, atol=1e-9, rtol=0
        )
        torch.testing.assert_close(
            torch.tensor(seq.advantages, dtype=torch.float64), want.adv_T, atol=1e-5, rtol=0
        )
    assert update.stats["minibatches"] == len(ref.minibatches), name
    for key in COMPARED_STATS:
        if key in ref.stats:
            got, expected = update.stats[key], ref.stats[key]
            assert math.isclose(got, expected, rel_tol=STAT_RTOL, abs_tol=STAT_ATOL), (
                name,
                key,
                got,
                expected,
            )
    assert r.error < MATCH_RTOL, (name, r.error)
