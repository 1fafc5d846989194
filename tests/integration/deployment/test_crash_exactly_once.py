"""Every trajectory is trained exactly once into weights that survive, whenever the trainer dies:
a separate `rlgateway train` SIGKILLed before its first checkpoint, in the middle of a step, and
after a checkpoint while the gateway already serves a newer version, then started again against
the same live `rlgateway serve`. Agents run in a thread, as a user's would (where the kill must
land between two steps, they stop after two steps' worth, and resume once the lost sessions are
trained again); the count comes from the store."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.deployment import db_path, last_step, query, run_config, trainer, wait_until
from tests.support.gateway_server import GatewayHandle, run_gateway

pytestmark = pytest.mark.slow

BATCH = 4


@contextlib.contextmanager
def agents(gw: GatewayHandle, run_id: str, groups: int | None = None) -> Iterator[None]:
    """Agents in a thread: GRPO groups of 2 (a chat turn, a reward, the end), one after another,
    waiting while the gateway's admission says 429, until the block exits (or `groups` are
    done)."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def loop() -> None:
        g = 0
        try:
            with httpx.Client(base_url=gw.url, headers=gw.admin_headers, timeout=60) as admin:
                while not stop.is_set() and (groups is None or g < groups):
                    r = admin.post(
                        f"/runs/{run_id}/sessions", json={"count": 2, "group_id": f"g{g}"}
                    )
                    if r.status_code == 429:
                        time.sleep(0.05)
                        continue
                    assert r.status_code == 201, r.text
                    g += 1
                    for s in r.json()["sessions"]:
                        key = {"Authorization": f"Bearer {s['api_key']}"}
                        base = f"/sessions/{s['id']}"
                        c = admin.post(
                            f"{base}/v1/chat/completions",
                            headers=key,
                            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
                        )
                        assert c.status_code == 200, c.text
                        text = c.json()["choices"][0]["message"]["content"] or ""
                        reward = sum(ch.islower() for ch in text) / 8
                        admin.post(f"{base}/reward", headers=key, json={"reward": reward})
                        admin.post(f"{base}/end", headers=key)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=120)
    assert not errors, errors


def states(db: Path, run_id: str) -> dict[str, tuple[str, int | None, str | None]]:
    """Session id -> (train_state, consumed_step, outcome) of every rewarded session."""
    rows = query(
        db,
        "SELECT id, train_state, consumed_step, outcome FROM sessions WHERE run_id = ? AND "
        "id IN (SELECT session_id FROM rewards)",
        run_id,
    )
    return {sid: (state, step, outcome) for sid, state, step, outcome in rows}


def consumed(db: Path, run_id: str) -> set[str]:
    return {sid for sid, (state, _, _) in states(db, run_id).items() if state == "consumed"}


def assert_exactly_once(db: Path, run_id: str, steps: int, *, stale: bool = False) -> None:
    """Each of steps 1..`steps` (of the surviving weights) trained one batch of whole groups;
    nothing was dropped (but, where `stale` allows it, trajectories sampled by lost weights too
    far from the surviving ones); what is not trained waits in the queue (the agents kept going
    after the last step), none under a lease."""
    per_step: dict[int, int] = {}
    allowed = (None, "trained", "stale") if stale else (None, "trained")
    for state, step, outcome in states(db, run_id).values():
        assert outcome in allowed, (state, step, outcome)
        if state == "consumed":
            assert step is not None
            per_step[step] = per_step.get(step, 0) + 1
        else:
            assert state == "pending", state
    assert per_step == dict.fromkeys(range(1, steps + 1), BATCH)


def crashed_config(tmp_path: Path, gw: GatewayHandle, run_id: str, **kw: object) -> Path:
    return run_config(
        tmp_path,
        run=run_id,
        database_url=gw.database_url,
        eta=2,
        batch_size=BATCH,
        **kw,
    )


def test_killed_before_its_first_checkpoint(tiny_model: Path, tmp_path: Path) -> None:
    """checkpoint_every 3: steps 1 and 2 are published, then the trainer dies with no checkpoint.
    Their weights are lost, so their sessions go back to the queue and are trained again from
    the initial weights (published as the version after the one served, an alias of version 0),
    never judged stale by the inflated number."""
    with run_gateway(tiny_model, tmp_path) as gw:
        db = db_path(gw)
        run_id = gw.create_run("crash", {"batch_size": BATCH, "group_size": 2, "eta": 2})
        config = crashed_config(tmp_path, gw, run_id, max_steps=3, checkpoint_every=3)
        first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
        logs = [first_log, second_log, gw.log_path]
        # two steps' worth of groups, so the first trainer reaches step 2 and can never start
        # step 3 (whose end would checkpoint) before the kill lands
        first_agents = agents(gw, run_id, groups=2 * BATCH // 2)
        with first_agents, trainer(config, first_log, gw.url) as first:
            wait_until(lambda: last_step(db, run_id) >= 2, "step 2", logs)
            first.send_signal(signal.SIGKILL)
            first.wait()
        assert last_step(db, run_id) == 2
        assert not list((tmp_path / "ckpt").glob("step-*"))
        trained_by_lost = consumed(db, run_id)
        assert len(trained_by_lost) == 2 * BATCH
        with trainer(config, second_log, gw.url) as second:
            # the lost sessions go back and are trained again first; agents then feed step 3
            wait_until(lambda: "go back" in second_log.read_text(), "the lost sessions back", logs)
            wait_until(lambda: consumed(db, run_id) >= trained_by_lost, "steps 1 and 2", logs)
            with agents(gw, run_id):
                assert second.wait(timeout=180) == 0, second_log.read_text()
        out = second_log.read_text()
        assert f"{len(trained_by_lost)} sessions trained after step 0 go back" in out, out
        assert gw.client.get("/admin/version").json()["version"] == 2 + 1 + 3
        trained = states(db, run_id)
        # the lost steps' sessions, sampled by versions 0 and 1 (0 and 1 step from the initial
        # weights), are trained again by steps 1 and 2 of the surviving weights
        assert sorted(trained[sid][:3] for sid in trained_by_lost) == sorted(
            [("consumed", 1, "trained")] * BATCH + [("consumed", 2, "trained")] * BATCH
        )
    # sessions sampled by version 2 (two lost steps away) may be too stale for step 3
    assert_exactly_once(db, run_id, 3, stale=True)
    assert (tmp_path / "ckpt" / "step-000003").is_dir()


def test_killed_mid_step_takes_back_its_batch_at_once(tiny_model: Path, tmp_path: Path) -> None:
    """Killed while a step holds its batch (lease 600 s): the restarted trainer has the same
    identity and takes the batch back at once, and trains it (it is not dropped as stale)."""
    with run_gateway(tiny_model, tmp_path) as gw:
        db = db_path(gw)
        run_id = gw.create_run("crash", {"batch_size": BATCH, "group_size": 2, "eta": 2})
        # many PPO epochs make a step long enough to be caught in the middle
        config = crashed_config(tmp_path, gw, run_id, max_steps=2, algo={"ppo_epochs": 40})
        first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
        logs = [first_log, second_log, gw.log_path]

        def leased() -> set[str]:
            rows = query(db, "SELECT id FROM sessions WHERE train_state = 'claimed'")
            return {sid for (sid,) in rows}

        with agents(gw, run_id):
            with trainer(config, first_log, gw.url) as first:
                wait_until(lambda: len(leased()) >= BATCH, "a batch leased", logs)
                held = leased()
                first.send_signal(signal.SIGKILL)
                first.wait()
            assert last_step(db, run_id) == 0
            started = time.monotonic()
            with trainer(config, second_log, gw.url) as second:
                wait_until(lambda: last_step(db, run_id) >= 1, "step 1", logs)
                assert time.monotonic() - started < 120  # not the 600 s lease
                assert second.wait(timeout=180) == 0, second_log.read_text()
        out = second_log.read_text()
        assert f"{len(held)} sessions this trainer (trainer:{run_id}) held go back" in out, out
        trained = states(db, run_id)
        assert all(trained[sid][:2] == ("consumed", 1) for sid in held), trained
    assert_exactly_once(db, run_id, 2)


def test_killed_after_a_checkpoint_while_a_newer_version_is_served(
    tiny_model: Path, tmp_path: Path
) -> None:
    """checkpoint_every 2: step 3 is published (version 3) and lost. The resumed trainer
    republishes checkpoint 2's weights as version 4, an alias of version 2: step 3's sessions,
    requeued, were sampled at most 2 steps from those weights, and are trained under eta 2
    (they were dropped as stale before, counted against version 4's number)."""
    with run_gateway(tiny_model, tmp_path) as gw:
        db = db_path(gw)
        run_id = gw.create_run("crash", {"batch_size": BATCH, "group_size": 2, "eta": 2})
        config = crashed_config(tmp_path, gw, run_id, max_steps=4, checkpoint_every=2)
        first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
        logs = [first_log, second_log, gw.log_path]
        with agents(gw, run_id):
            with trainer(config, first_log, gw.url) as first:
                wait_until(lambda: last_step(db, run_id) >= 3, "step 3", logs)
                first.send_signal(signal.SIGKILL)
                first.wait()
            lost = {sid for sid, (_, step, _) in states(db, run_id).items() if step == 3}
            assert len(lost) == BATCH
            with trainer(config, second_log, gw.url) as second:
                assert second.wait(timeout=180) == 0, second_log.read_text()
        out = second_log.read_text()
        assert f"{BATCH} sessions trained after step 2 go back to the queue" in out, out
        # version 3 was served when it resumed: the checkpoint went out as 4, then steps 3, 4
        assert gw.client.get("/admin/version").json()["version"] == 6
        trained = states(db, run_id)
        assert all(trained[sid][0] == "consumed" for sid in lost), trained
    assert_exactly_once(db, run_id, 4)
