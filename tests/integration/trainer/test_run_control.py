"""The trainer obeys the run's status as the admin API sets it: paused starts no step and holds
no lease, resumed trains, stopped finishes; each step lands in the store as the time series and
version list the API serves."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from store.types import SessionFilter, TrainState
from tests.support.trainer_harness import ADMIN, harness, train_config
from trainer.backends.registry import build_backend
from trainer.loop import Trainer
from trainer.publish import LocalPublisher

pytestmark = pytest.mark.slow


async def test_pause_resume_stop_drive_the_trainer(tiny_model: Path, tmp_path: Path) -> None:
    async with harness(tiny_model, tmp_path) as h:
        run_id = await h.run({"batch_size": 4, "group_size": 2})
        for g in range(2):
            sessions = await h.group(run_id, 2, f"g{g}")
            await asyncio.gather(*(h.episode(s) for s in sessions))
        assert (await h.http.post(f"/runs/{run_id}/pause", headers=ADMIN)).status_code == 200
        cfg = train_config(
            run_id, tmp_path, max_steps=3, batch_size=4, group_size=2, poll_seconds=0.05
        )
        backend = build_backend(cfg.backend_config(str(tiny_model)))
        trainer = Trainer(cfg, h.store, backend, LocalPublisher(h.engine), report=lambda _: None)
        task = asyncio.create_task(trainer.run())
        try:
            await asyncio.sleep(1.0)
            # paused: no step, and nothing claimed
            assert trainer.step == backend.step == 0
            page, _ = await h.store.list_sessions(run_id, SessionFilter(), limit=10)
            assert {s.info.train_state for s in page} == {TrainState.PENDING}
            assert (await h.store.list_steps(run_id)) == []

            await h.http.post(f"/runs/{run_id}/resume", headers=ADMIN)
            deadline = time.monotonic() + 120
            while not (await h.store.list_steps(run_id)):
                assert not task.done(), task
                assert time.monotonic() < deadline, "no step within 120 s of resuming"
                await asyncio.sleep(0.05)
            m = (await h.http.get(f"/runs/{run_id}/metrics", headers=ADMIN)).json()
            assert m["steps"] == [1]
            for name in ("reward_mean", "loss", "staleness_mean", "tokens_per_s", "step_seconds"):
                assert isinstance(m["series"][name][0], float), name
            # the step's parts: its math, its checkpoint and its publish, within the whole
            parts = [m["series"][f"{k}_seconds"][0] for k in ("update", "checkpoint", "publish")]
            assert all(p > 0 for p in parts)
            assert sum(parts) <= m["series"]["step_seconds"][0]
            v = (await h.http.get(f"/runs/{run_id}/versions", headers=ADMIN)).json()
            assert v["engine_version"] == 1
            [published] = v["versions"]
            assert published["version"] == 1
            assert await asyncio.to_thread(Path(published["checkpoint"]).is_dir)

            # only one batch of data: the trainer waits for more until the run is stopped
            await asyncio.sleep(0.5)
            assert not task.done()
            await h.http.post(f"/runs/{run_id}/stop", headers=ADMIN)
            await asyncio.wait_for(task, 30)
            assert trainer.step == 1  # one training step (its mini-batches: optimizer steps)
            assert h.engine.version() == 1
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
