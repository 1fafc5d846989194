"""Every algorithm preset trains through the real loop: `Trainer.run` (built by `build_trainer`)
claims recorded trajectories from a real store, takes two steps on the tiny model, and reports
finite metrics, including the preset's own (the critic's for ppo, the KL for reinforce_pp, ...)."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from rlgateway.build import build_trainer
from store import Store
from store.types import CompletionRecord
from tests.support.reference import load_model
from trainer.algorithms.config import PRESETS
from trainer.config import TrainConfig

pytestmark = pytest.mark.slow

BATCH, GROUP, STEPS = 4, 2, 2
MAX_TOKENS = 16
REWARDS = [[1.0, 0.0], [0.5, 0.5], [0.2, 0.9], [0.0, 0.6]]
"""Per group of two, each session's reward; the second group is uniform, and its turns are short
enough for overlong shaping to leave it so (dynamic sampling drops it)."""
SHORT = 8
"""max_tokens - overlong_buffer: longer turns are penalised under dapo."""


def record(
    cid: str, sid: str, rng: random.Random, *, prefix: list[int], longest: int
) -> CompletionRecord:
    """A turn of random byte tokens continuing the segment `prefix` (empty: it opens it)."""
    prompt = prefix + [rng.randrange(256) for _ in range(5)]
    output = [rng.randrange(256) for _ in range(rng.randint(6, longest))]
    return CompletionRecord(
        id=cid,
        session_id=sid,
        segment_id=f"{sid}-seg0",
        segment_index=0,
        opens_segment=not prefix,
        prefix_break=False,
        transcript={"messages": [{"role": "user", "content": cid}]},
        prefix_len=len(prefix),
        prompt_ids=prompt,
        output_ids=output,
        logprobs=[-5.6 + rng.uniform(-0.5, 0.5) for _ in output],
        versions=[0] * len(output),
        finish_reason="stop",
        sampling={"temperature": 1.0},
    )


async def record_run(store: Store, config: dict[str, Any]) -> str:
    """A run of ended, rewarded sessions in groups of two; the first session of each group has
    two turns (with a turn reward), the second one."""
    run = await store.create_run("presets", config)
    rng = random.Random(0)
    for g, rewards in enumerate(REWARDS):
        sessions = await store.create_sessions(run.id, GROUP, group_id=f"g{g}")
        longest = SHORT if len(set(rewards)) == 1 else MAX_TOKENS - 2
        for k, (new, reward) in enumerate(zip(sessions, rewards, strict=True)):
            sid = new.info.id
            first = record(f"{sid}-0", sid, rng, prefix=[], longest=longest)
            await store.record_completions([first])
            if k == 0:
                segment = [*first.prompt_ids, *first.output_ids]
                await store.record_completions(
                    [record(f"{sid}-1", sid, rng, prefix=segment, longest=longest)]
                )
                await store.add_reward(sid, 0.25, completion_id=first.id)
                reward -= 0.25
            await store.add_reward(sid, reward)
            await store.end_session(sid)
    return run.id


@pytest.mark.parametrize("preset", list(PRESETS))
async def test_preset_trains_two_steps_through_the_loop(
    preset: str, tiny_model: Path, tmp_path: Path
) -> None:
    store = await Store.connect(f"sqlite:///{tmp_path / 'store.db'}")
    try:
        run_config = {"batch_size": BATCH, "eta": STEPS}
        run_id = await record_run(store, run_config)
        algo = {"overlong_buffer": MAX_TOKENS - SHORT} if preset == "dapo" else {}
        cfg = TrainConfig.model_validate(
            {
                "run": run_id,
                "database_url": "sqlite:///unused",
                "checkpoint_dir": str(tmp_path / "ckpt"),
                "tensorboard": False,
                "algorithm": preset,
                "algo": algo,
                "optim": {"lr": 1e-3},
                "group_size": GROUP,
                "max_steps": STEPS,
                "max_tokens": MAX_TOKENS,
                "token_budget": 64,
                **run_config,
            }
        )
        rows: list[dict[str, Any]] = []
        trainer = await build_trainer(cfg, store, None, tiny_model, report=rows.append)
        try:
            await trainer.run()
            state = trainer.backend.full_state_dict()
        finally:
            trainer.close()
    finally:
        await store.close()

    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        bad = {k: v for k, v in r.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, (preset, bad)
        assert r["minibatches"] >= 1
        assert r["entropy"] > 0
    initial = load_model(tiny_model).state_dict()
    moved = max(float((state[k].double() - initial[k]).abs().max()) for k in initial)
    assert moved > 1e-4, preset

    algo_cfg = cfg.algorithm_config()
    for r in rows:
        assert ("value_loss" in r) == algo_cfg.use_critic, (preset, r)
        assert ("kl_ref" in r) == (algo_cfg.kl_coef > 0), (preset, r)
        assert (r["imp_weight_max"] != 1.0) == algo_cfg.decoupled, (preset, r)
    if preset == "ppo":
        for r in rows:
            assert r["value_loss"] > 0
            assert r["explained_variance"] <= 1
            assert r["critic_grad_norm"] > 0
    if preset == "reinforce_pp":
        assert all(r["kl_ref"] != 0 for r in rows)  # behaviour and reference logprobs differ
    if preset == "gspo":
        # the GSPO clip (3e-4 / 4e-4) binds on the sequence ratio once the policy moves
        assert any(r["clip_frac_low"] + r["clip_frac_high"] > 0 for r in rows)
    if preset == "dapo":
        assert sum(r["dropped"] for r in rows) == GROUP  # the uniform group
        raw = [reward for group in REWARDS for reward in group if len(set(group)) > 1]
        # overlong shaping: turns longer than SHORT lose reward
        assert sum(r["reward_mean"] * r["trajectories"] for r in rows) < sum(raw) - 1e-6
    else:
        assert all(r["dropped"] == 0 for r in rows)
    assert torch.isfinite(torch.cat([v.flatten() for v in state.values()])).all()
