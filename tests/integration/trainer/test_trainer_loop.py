"""The asynchronous RL loop end to end, in one process: agents talk to the real gateway (local
engine, SQLite store), a grader posts rewards, the trainer (FSDP backend) claims trajectories,
trains, and hot-swaps each new policy into the engine while the agents keep running."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch

from engines.tiny_model import tiny_model_dir
from tests.support.trainer_harness import (
    MAX_TOKENS,
    Harness,
    consumed_per_step,
    harness,
    record_trajectories,
    train_config,
    write_run_config,
)
from trainer import checkpoint
from trainer.backends.registry import build_backend, build_value_backend
from trainer.config import TrainConfig
from trainer.loop import Trainer
from trainer.loss import make_value_loss_fn
from trainer.publish import LocalPublisher
from trainer.sequences import build_sequences, with_gae

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("engine_kind", ["local", "process"])
async def test_engine_and_trainer_logprobs_agree_on_recorded_tokens(
    tiny_model: Path, tmp_path: Path, engine_kind: str
) -> None:
    async with harness(tiny_model, tmp_path, engine_kind) as h:
        run_id = await h.run({"batch_size": 8})
        for g in range(2):
            sessions = await h.group(run_id, 4, f"g{g}")
            await asyncio.gather(*(h.episode(s) for s in sessions))
        cfg = train_config(run_id, tmp_path)
        trajs = await h.store.claim(run_id, limit=8, owner="t", lease_seconds=60)
        assert len(trajs) == 8
        built = build_sequences(trajs, cfg.algorithm_config())
        backend = build_backend(cfg.backend_config(str(tiny_model)))
        logps = backend.forward_logprobs(built.sequences, 1.0)
        worst = 0.0
        for seq, logp in zip(built.sequences, logps, strict=True):
            for m, engine_lp, trainer_lp in zip(
                seq.loss_mask, seq.behav_logprobs, logp, strict=True
            ):
                if m:
                    worst = max(worst, abs(engine_lp - trainer_lp))
        assert worst <= 1e-4  # on-policy, the importance ratio exp(trainer - engine) is 1


@pytest.mark.parametrize(("lr", "learns"), [(1e-3, True), (0.0, False)], ids=["lr1e-3", "lr0"])
async def test_async_grpo_through_the_gateway_learns_within_the_staleness_bound(
    tiny_model: Path, tmp_path: Path, lr: float, learns: bool
) -> None:
    eta, steps, batch, group = 1, 8, 16, 4
    config = {"eta": eta, "batch_size": batch, "group_size": group}
    async with harness(tiny_model, tmp_path) as h:
        run_id = await h.run(config)
        cfg = train_config(run_id, tmp_path, max_steps=steps, optim={"lr": lr, "seed": 0}, **config)
        backend = build_backend(cfg.backend_config(str(tiny_model)))
        trainer = Trainer(cfg, h.store, backend, LocalPublisher(h.engine))
        # more agents than the bound admits: (eta + 1) * batch = 32 sessions, 10 loops x 4 want 40
        agents = asyncio.create_task(h.agents(run_id, group, steps, concurrency=10))
        await trainer.run()
        agents.cancel()
        await asyncio.gather(agents, return_exceptions=True)
        assert h.engine.version() == steps
        # no trained token is older than eta versions: a session consumed at step s was trained
        # by the policy of version s - 1
        consumed = h.consumed()
        trained = {sid: step for sid, step in consumed.items() if step >= 1}
        assert len(trained) == steps * batch
        for sid, step in trained.items():
            detail = await h.store.session_detail(sid)
            versions = [v for seg in detail.segments for v in seg.versions if v >= 0]
            assert min(versions) >= step - 1 - eta, (sid, step, versions)
        assert h.rejected > 0  # admission really held agents back
        # The mechanism, whatever the schedule: the trained weights moved every trained group's
        # better-than-average replies up against its worse ones (the policy gradient's sign on
        # the data it trained), and lr 0 moved nothing. (Learning curves are the demo's and
        # bench_async's to show: which sessions train when depends on the machine's load.)
        gain = await reward_weighted_logprob_change(h, trained, cfg, tiny_model, backend)
        if learns:
            assert gain > 0, gain
        else:
            assert abs(gain) < 1e-6, gain


async def reward_weighted_logprob_change(
    h: Harness, sessions: dict[str, int], cfg: TrainConfig, tiny_model: Path, trained: Any
) -> float:
    """sum over `sessions` of (reward - its group's mean reward) x (the sampled tokens' total
    logprob under the trained weights - under the initial ones)."""
    from trainer.batch import TrainSequence

    details = [await h.store.session_detail(sid) for sid in sorted(sessions)]
    seqs = [
        TrainSequence(
            tokens=seg.tokens,
            loss_mask=seg.loss_mask,
            behav_logprobs=[0.0] * len(seg.tokens),
            advantages=[0.0] * len(seg.tokens),
            versions=[-1] * len(seg.tokens),
        )
        for d in details
        for seg in d.segments[:1]
    ]
    initial = build_backend(cfg.backend_config(str(tiny_model)))
    before = initial.forward_logprobs(seqs, cfg.temperature)
    after = trained.forward_logprobs(seqs, cfg.temperature)
    rewards = [sum(r.value for r in d.rewards) for d in details]
    groups: dict[str | None, list[float]] = defaultdict(list)
    for d, r in zip(details, rewards, strict=True):
        groups[d.info.group_id].append(r)
    gain = 0.0
    for d, r, seq, lp0, lp1 in zip(details, rewards, seqs, before, after, strict=True):
        mean = sum(groups[d.info.group_id]) / len(groups[d.info.group_id])
        change = sum(b - a for a, b, m in zip(lp0, lp1, seq.loss_mask, strict=True) if m)
        gain += (r - mean) * change
    return gain


@pytest.mark.parametrize("engine_kind", ["local", "process"])
async def test_synchronous_mode_trains_only_current_policy_tokens(
    tiny_model: Path, tmp_path: Path, engine_kind: str
) -> None:
    """Each new policy is hot-swapped into the engine (in this process, or into the engine
    process through shared memory) before the next batch is sampled."""
    config = {"eta": 0, "batch_size": 8, "group_size": 4}
    async with harness(tiny_model, tmp_path, engine_kind) as h:
        run_id = await h.run(config)
        cfg = train_config(
            run_id, tmp_path, max_steps=3, optim={"lr": 1e-3}, tensorboard=True, **config
        )
        backend = build_backend(cfg.backend_config(str(tiny_model)))
        rows: list[dict[str, Any]] = []
        trainer = Trainer(cfg, h.store, backend, LocalPublisher(h.engine), report=rows.append)
        agents = asyncio.create_task(h.agents(run_id, 4, 3))
        await trainer.run()
        agents.cancel()
        await asyncio.gather(agents, return_exceptions=True)
        assert h.engine.version() == 3
        assert [r["staleness_max"] for r in rows] == [0, 0, 0]
        assert [r["trajectories"] for r in rows] == [8, 8, 8]
        # every trained token is on-policy: the engine-vs-trainer mismatch is the kernels' alone
        assert all(r["mismatch_tokens"] == r["tokens"] > 0 for r in rows), rows
        assert all(r["mismatch_abs_max"] < 1e-3 for r in rows), rows
        assert all(0 <= r["mismatch_kl"] < 1e-6 for r in rows), rows
        assert list((tmp_path / "ckpt" / "tb").glob("events.out.tfevents.*"))


def test_sigkill_mid_run_resumes_and_trains_each_trajectory_exactly_once(
    tiny_model: Path, tmp_path: Path
) -> None:
    import os
    import signal
    import subprocess
    import sys
    import time

    batch, steps = 4, 4
    run_id = record_trajectories(tiny_model, tmp_path, batch * steps)
    # eta = steps: all the data was sampled by version 0, before training started
    config = write_run_config(
        tmp_path, tiny_model, run_id, batch_size=batch, max_steps=steps, eta=steps
    )
    ckpt = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "rlgateway.cli", "train", "--config", str(config)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = tmp_path / "first.log"
    with log.open("w") as out:
        first = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while not (ckpt / "step-000002").exists():
            assert first.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "no checkpoint within 120 s"
            time.sleep(0.01)
        first.send_signal(signal.SIGKILL)  # mid-run: right after a checkpoint, before or after
        first.wait()  # its sessions were marked consumed
    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stdout + second.stderr
    # none lost, none trained twice: every step trained exactly one batch
    assert consumed_per_step(tmp_path / "store.db") == dict.fromkeys(range(1, steps + 1), batch)


@pytest.mark.parametrize(
    ("algorithm", "backend"),
    [("grpo", "fsdp"), ("ppo", "fsdp"), ("grpo", "fsdp:t2"), ("ppo", "archon:e2")],
)
def test_trainer_under_torchrun_with_two_processes(
    tiny_model: Path, tmp_path: Path, algorithm: str, backend: str
) -> None:
    """`rlgateway train` under torchrun on trajectories the gateway recorded (the README's ladder):
    FSDP2 data parallel on the tiny model, tensor parallel on the demo-sized one (its heads split
    over 2), or the MoE backend with the experts split over the two ranks on the tiny Qwen3-MoE
    (its policy and critic, with the router's balance loss weighted in)."""
    import os
    import subprocess
    import sys

    from tests.support.gateway_server import free_port

    moe = backend.startswith("archon")
    if moe:
        model = tiny_model_dir(moe=True)
    else:
        model = tiny_model_dir(size="demo") if backend == "fsdp:t2" else tiny_model
    batch, steps = 4, 3
    run_id = record_trajectories(model, tmp_path, batch * steps)
    section = {"allocation": backend, "aux_loss_coef": 0.01} if moe else backend
    config = write_run_config(
        tmp_path,
        model,
        run_id,
        batch_size=batch,
        max_steps=steps,
        eta=steps,
        backend=section,
    )
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(port),
        "-m",
        "rlgateway.cli",
        "train",
        "--config",
        str(config),
        f"algorithm={algorithm}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert consumed_per_step(tmp_path / "store.db") == dict.fromkeys(range(1, steps + 1), batch)
    metrics = (tmp_path / "ckpt" / "metrics.jsonl").read_text()
    rows = [json.loads(line) for line in metrics.splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))  # written by rank 0 only
    # with a critic, both ranks trained it and its sharded state was checkpointed
    assert all(("value_loss" in r) == (algorithm == "ppo") for r in rows)
    assert (tmp_path / "ckpt" / f"step-{steps:06d}" / "critic").is_dir() == (algorithm == "ppo")
    # the MoE backend reports its router: balance loss and the least and most loaded expert
    router = {"moe_balance_loss", "moe_load_min", "moe_load_max"}
    assert all((router <= r.keys()) == moe for r in rows)
    # ... and so does its MoE critic, under the critic's name
    assert all(("critic_moe_balance_loss" in r) == moe for r in rows)
    assert all(r["moe_load_min"] <= 1.0 <= r["moe_load_max"] for r in rows if moe)


async def test_ppo_trains_a_critic_and_resumes_it_exactly(tiny_model: Path, tmp_path: Path) -> None:
    """The ppo preset through the real gateway: the loop trains policy and critic each step and
    reports value loss and explained variance; a fresh trainer resumes both from the checkpoint
    exactly (weights and optimizer: the next critic steps agree bit for bit), and on a fixed batch
    of new trajectories the critic's value loss goes down."""
    steps, batch = 3, 8
    config = {"eta": 1, "batch_size": batch, "group_size": 4}
    async with harness(tiny_model, tmp_path) as h:
        run_id = await h.run(config)
        cfg = train_config(
            run_id,
            tmp_path,
            algorithm="ppo",
            max_steps=steps,
            optim={"lr": 1e-3},
            critic={"lr": 1e-4},
            **config,
        )
        model = str(tiny_model)
        backend = build_backend(cfg.backend_config(model))
        critic = build_value_backend(cfg.critic_backend_config(model))
        rows: list[dict[str, Any]] = []
        trainer = Trainer(
            cfg, h.store, backend, LocalPublisher(h.engine), critic=critic, report=rows.append
        )
        agents = asyncio.create_task(h.agents(run_id, 4, steps))
        await trainer.run()
        agents.cancel()
        await asyncio.gather(agents, return_exceptions=True)
        assert h.engine.version() == steps
        assert [r["step"] for r in rows] == [1, 2, 3]
        for r in rows:
            for key in ("value_loss", "explained_variance", "critic_grad_norm", "value_mean"):
                assert isinstance(r[key], float), (key, r)
            assert r["value_loss"] > 0
            assert r["explained_variance"] <= 1
        found = checkpoint.latest(tmp_path / "ckpt")
        assert found is not None
        assert (found[0] / checkpoint.CRITIC).is_dir()

        # a new trainer process would do this: fresh models, resume from the newest checkpoint
        critic2 = build_value_backend(cfg.critic_backend_config(model))
        resumed = Trainer(
            cfg, h.store, build_backend(cfg.backend_config(model)), None, critic=critic2
        )
        assert await resumed.resume() == steps
        # the optimizer steps (one per mini-batch) are restored with the training step
        assert critic2.step == critic.step > steps
        a, b = critic.full_state_dict(), critic2.full_state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a)

        # a fixed batch of fresh trajectories (the engine is idle at version 3 now), in a run of
        # their own: the agents may have filled the first run's admission to its bound (the
        # cancelled ones' sessions never end), which would hold every new group back
        fixed_run = await h.run(config)
        for g in range(2):
            sessions = await h.group(fixed_run, 4, f"fixed{g}")
            await asyncio.gather(*(h.episode(s) for s in sessions))
        trajs = await h.store.claim(fixed_run, limit=batch, owner="t", lease_seconds=60)
        assert len(trajs) == batch
        built = build_sequences(trajs, cfg.algorithm_config(), max_tokens=MAX_TOKENS)
        assert built.token_rewards is not None
        loss_fn = make_value_loss_fn(cfg.algorithm_config())

        def critic_steps(c: Any, n: int) -> list[dict[str, float]]:
            values = c.forward_values(built.sequences, token_budget=cfg.token_budget)
            assert built.token_rewards is not None
            seqs = with_gae(built.sequences, built.token_rewards, values, cfg.algorithm_config())
            norm = float(sum(s.num_loss_tokens for s in seqs))
            return [
                c.train_step(
                    seqs, loss_fn, temperature=1.0, token_budget=cfg.token_budget, global_norm=norm
                )
                for _ in range(n)
            ]

        # the resumed critic continues exactly: optimizer moments and schedule were restored too
        assert critic_steps(critic, 3) == critic_steps(critic2, 3)
        # a new critic (no moments from the loop's batches) fits this fixed batch step by step
        fresh = build_value_backend(
            cfg.critic_backend_config(model).model_copy(update={"lr": 2e-5})
        )
        losses = [s["loss"] for s in critic_steps(fresh, 8)]
        # Adam may overshoot by a little near the fit (seen: 0.0155 -> 0.0165 at step 5, and
        # 0.0089 -> 0.0092 -> 0.0103 at steps 3-5), so the claim is the fit, not a loss that
        # falls at every step: far below the start, and the last steps near the best one. Eight
        # steps: how fast it fits depends on the batch the agents sampled (one fell 11% a step,
        # 0.819 -> 0.497 in five, just short of 0.6 of its start).
        assert losses[-1] < 0.6 * losses[0], losses
        assert min(losses[-2:]) <= 1.25 * min(losses), losses
