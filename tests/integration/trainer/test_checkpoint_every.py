"""Checkpoints every `checkpoint_every` steps with exactly-once kept, versions that only grow
across a resume, and a lease renewed while a long step runs: the trainer in this process on a
store recorded through the real gateway (the harness of
tests/integration/trainer/test_trainer_loop.py)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from store import Store
from tests.support.trainer_harness import (
    consumed_per_step,
    record_trajectories,
    train_config,
)
from trainer import checkpoint
from trainer.backends.registry import build_backend
from trainer.loop import Trainer
from trainer.weights import Weights

pytestmark = pytest.mark.slow


class Engines:
    """The engines as a publisher sees them: the version they serve."""

    def __init__(self) -> None:
        self.version = 0
        self.published: list[int] = []

    async def publish(self, weights: Weights, version: int) -> int:
        if version == self.version:
            return version
        assert version > self.version, "versions only grow"
        self.version = version
        self.published.append(version)
        return version

    async def served(self) -> int:
        return self.version


def test_checkpoint_every_requeues_the_lost_steps_and_versions_keep_growing(
    tiny_model: Path, tmp_path: Path
) -> None:
    batch = 4
    run_id = record_trajectories(tiny_model, tmp_path, batch * 4)
    db = tmp_path / "store.db"
    cfg = train_config(
        run_id,
        tmp_path,
        database_url=f"sqlite:///{db}",
        batch_size=batch,
        group_size=2,
        eta=100,
        max_steps=4,
        checkpoint_every=2,
        optim={"lr": 1e-3},
    )
    engines = Engines()

    async def go() -> tuple[Trainer, Trainer]:
        store = await Store.connect(f"sqlite:///{db}")
        try:
            stop = asyncio.Event()

            def after(row: dict[str, Any]) -> None:
                if row["step"] == 3:  # the trainer dies after step 3: checkpoint 2 is the newest
                    stop.set()

            model = str(tiny_model)
            first = Trainer(
                cfg, store, build_backend(cfg.backend_config(model)), engines, report=after
            )
            await first.resume()
            await first.run(stop)
            assert first.step == 3
            found = checkpoint.latest(Path(cfg.checkpoint_dir))
            assert found is not None
            assert found[1].step == 2, "step 3 is not a checkpoint step"
            assert consumed_per_step(db) == {1: batch, 2: batch, 3: batch, None: batch}

            second = Trainer(cfg, store, build_backend(cfg.backend_config(model)), engines)
            assert await second.resume() == 2
            # step 3's sessions are back in the queue: its weights died with the trainer
            assert consumed_per_step(db) == {1: batch, 2: batch, None: 2 * batch}
            # the engines serve version 3 (step 3's weights): checkpoint 2's weights go out as
            # version 4, never as an older version
            assert second.version == engines.version == 4
            await second.run()
            return first, second
        finally:
            await store.close()

    _, second = asyncio.run(go())
    assert second.step == 4
    assert engines.published == [1, 2, 3, 4, 5, 6]
    # every trajectory trained exactly once; step 3 was redone by the second trainer
    assert consumed_per_step(db) == dict.fromkeys(range(1, 5), batch)
    found = checkpoint.latest(Path(cfg.checkpoint_dir))
    assert found is not None
    assert (found[1].step, found[1].policy_version) == (4, 6)


def test_a_step_longer_than_the_lease_keeps_its_claim(tiny_model: Path, tmp_path: Path) -> None:
    batch = 4
    run_id = record_trajectories(tiny_model, tmp_path, batch)
    db = tmp_path / "store.db"
    # renewed every third of it: a 2 s lease leaves the event loop 1.3 s of slack between
    # renewals (with 1 s, a loaded CI machine once stalled it past the lease)
    lease = 2.0
    cfg = train_config(
        run_id,
        tmp_path,
        database_url=f"sqlite:///{db}",
        batch_size=batch,
        group_size=2,
        eta=100,
        max_steps=1,
        lease_seconds=lease,
        optim={"lr": 1e-3},
    )

    async def go() -> None:
        store = await Store.connect(f"sqlite:///{db}")
        try:
            backend = build_backend(cfg.backend_config(str(tiny_model)))
            slow_step = backend.train_step

            def train_step(*args: Any, **kwargs: Any) -> dict[str, float]:
                time.sleep(lease)  # each mini-batch outlasts the lease on its own
                return slow_step(*args, **kwargs)

            backend.train_step = train_step  # type: ignore[method-assign]
            trainer = Trainer(cfg, store, backend, None)
            started = time.monotonic()
            await trainer.run()
            assert time.monotonic() - started > 2 * lease
            assert trainer.step == 1
        finally:
            await store.close()

    asyncio.run(go())
    # marked consumed at step 1 although the step took several leases: the lease was renewed
    assert consumed_per_step(db) == {1: batch}
