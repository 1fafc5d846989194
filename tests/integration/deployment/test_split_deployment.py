"""The split deployment (`rlgateway serve` + a separate `rlgateway train`, README's example)
across restarts: the newest published policy is recorded in the store and served again by a
restarted gateway; republishing the version served is a no-op; a trainer killed with SIGKILL
and started again resumes against the live gateway; the run owns its config, and a trainer's
config that disagrees with it is refused.

The process tests run real processes over loopback (`run_gateway`, and `rlgateway train` as a
subprocess), with the agents of `test_training_processes.drive` producing trajectories.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from engines.local import LocalEngine
from gateway.published import restore_policy
from rlgateway.embedded import RecordingPublisher
from rlgateway.run_merge import merge_run_config, stored_form
from store import Store
from tests.support.admin_client import ADMIN, app_client
from tests.support.deployment import (
    db_path,
    drive,
    last_step,
    query,
    run_config,
    trainer,
    wait_until,
)
from tests.support.gateway_server import GatewayHandle, run_gateway
from tests.support.procs import live_children
from tests.support.trainer_harness import consumed_per_step
from trainer.config import TrainConfig
from trainer.publish import LocalPublisher
from trainer.weights import StateDictWeights

# -- the run owns its config ---------------------------------------------------------------------


def train_config(**given: Any) -> TrainConfig:
    return TrainConfig.model_validate({"run": "run_x", **given})


def test_a_setting_both_configs_give_differently_is_refused_naming_both_values() -> None:
    stored = {"eta": 2, "batch_size": 4, "optim": {"lr": 1e-3}}
    with pytest.raises(ValueError, match="the run owns its config") as err:
        merge_run_config(stored, train_config(eta=1, batch_size=4, optim={"lr": 1e-4}))
    message = str(err.value)
    assert "eta: the run's config says 2, --config says 1" in message
    assert "optim.lr: the run's config says 0.001, --config says 0.0001" in message
    assert "batch_size" not in message  # given by both, with one value: no conflict


def test_settings_one_config_leaves_out_come_from_the_other() -> None:
    stored = {"eta": 2, "optim": {"lr": 1e-3}, "algo": {"eps_low": 0.1}}
    ours = train_config(
        batch_size=4, group_size=2, optim={"weight_decay": 0.1}, algo={"kl_coef": 0.0}
    )
    merged = merge_run_config(stored, ours)
    assert (merged.run, merged.eta, merged.batch_size, merged.group_size) == ("run_x", 2, 4, 2)
    assert (merged.optim.lr, merged.optim.weight_decay) == (1e-3, 0.1)
    assert merged.algo == {"eps_low": 0.1, "kl_coef": 0.0}
    form = stored_form(merged)
    # every run-owned setting is spelled out, so the gateway admits by what is trained ...
    assert form["eta"] == 2
    assert form["batch_size"] == 4
    assert {"max_concurrent", "discount", "temperature", "client_sampling"} <= set(form)
    assert form["optim"] == {"lr": 1e-3, "weight_decay": 0.1}
    # ... and what neither config gave stays free for a later trainer; where is not how
    assert not {"max_steps", "lease_seconds", "run", "database_url"} & set(form)
    assert merge_run_config(form, train_config(max_steps=7)).max_steps == 7


def test_a_later_trainer_extends_the_runs_max_steps() -> None:
    """max_steps is the one setting a later trainer's config overrides: training a run further
    is starting its trainer again with more steps."""
    merged = merge_run_config({"max_steps": 10, "eta": 2}, train_config(max_steps=20))
    assert (merged.max_steps, merged.eta) == (20, 2)
    assert stored_form(merged)["max_steps"] == 20


def test_a_trainers_process_settings_replace_the_runs_and_never_conflict() -> None:
    """Identity, leases, polling, checkpoint cadence, logging and publishing are the process's
    (`ProcessSettings`): a restarted trainer may change them; a value stored with the run is
    a default for a trainer that gives none. The run's settings still conflict."""
    stored = {"eta": 2, "lease_seconds": 30, "poll_seconds": 1.0, "publish": {"keep": 3}}
    ours = train_config(lease_seconds=5, tensorboard=False, publish={"bucket_mb": 8})
    merged = merge_run_config(stored, ours)
    assert (merged.lease_seconds, merged.poll_seconds, merged.tensorboard) == (5, 1.0, False)
    assert (merged.publish.bucket_mb, merged.publish.keep) == (8, 2)  # the section is ours
    assert stored_form(merged)["lease_seconds"] == 5
    with pytest.raises(ValueError, match="eta: the run's config says 2, --config says 1"):
        merge_run_config(stored, train_config(eta=1, lease_seconds=5))


def test_the_backend_section_merges_key_by_key() -> None:
    """The run's allocation and a trainer's attention kernel make one backend; two allocations
    conflict, named by key."""
    merged = merge_run_config(
        {"backend": "fsdp:d2"}, train_config(backend={"type": "fsdp", "attention": "sdpa"})
    )
    assert (str(merged.backend), merged.backend.attention) == ("fsdp:d2", "sdpa")
    assert stored_form(merged)["backend"] == {
        "type": "fsdp",
        "allocation": "fsdp:d2",
        "attention": "sdpa",
    }
    conflict = "backend.allocation: the run's config says fsdp:d2, --config says fsdp:d4"
    with pytest.raises(ValueError, match=re.escape(conflict)):
        merge_run_config({"backend": "fsdp:d2"}, train_config(backend="fsdp:d4"))


def test_a_stored_config_that_is_no_training_config_is_refused() -> None:
    with pytest.raises(ValueError, match=r"stored config is not a training config \(config.task"):
        merge_run_config({"task": "x"}, train_config())


# -- the durable record and the no-op republish (in process) -------------------------------------


async def test_republishing_the_served_version_is_a_no_op_and_each_load_is_recorded(
    engine: LocalEngine,
    tiny_model: Path,
    store_url: str,
) -> None:
    async with app_client(engine, tiny_model, store_url) as c:
        served = engine.version()
        new = {"path": str(tiny_model), "version": served + 1}
        r = await c.http.post("/admin/weights", json=new, headers=ADMIN)
        assert r.status_code == 200, r.text
        assert r.json() == {"version": served + 1, "changed": True}
        recorded = await c.store.latest_policy()
        assert recorded is not None
        assert (recorded.version, recorded.path) == (served + 1, str(tiny_model))

        r = await c.http.post("/admin/weights", json=new, headers=ADMIN)  # a resumed trainer's
        assert r.status_code == 200, r.text
        assert r.json() == {"version": served + 1, "changed": False}
        assert await c.store.latest_policy() == recorded  # nothing loaded, nothing recorded
        assert engine.version() == served + 1

        older = {"path": str(tiny_model), "version": served}
        r = await c.http.post("/admin/weights", json=older, headers=ADMIN)
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "version"


async def test_a_gateway_restores_the_newest_policy_it_can_load_and_says_what_it_serves(
    engine: LocalEngine,
    tiny_model: Path,
    store_url: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="gateway.published")
    store = await Store.connect(store_url)
    try:
        v = engine.version()
        await store.record_policy(v + 1, str(tiny_model))
        assert await restore_policy(engine, store) == v + 1 == engine.version()
        assert f"serving the newest published policy: version {v + 1}" in caplog.text

        await store.record_policy(v + 2, None)  # serve --train's in-process weights
        assert await restore_policy(engine, store) == v + 1
        assert f"version {v + 2}, was handed over in process" in caplog.text

        await store.record_policy(v + 3, str(tmp_path / "gone"))
        assert await restore_policy(engine, store) == v + 1
        assert f"version {v + 3}, was loaded from {tmp_path / 'gone'}, which no longer" in (
            caplog.text
        )
        assert engine.version() == v + 1
    finally:
        await store.close()


async def test_in_process_publishes_are_recorded_without_a_directory(
    engine: LocalEngine,
    tiny_model: Path,
    store_url: str,
) -> None:
    from safetensors.torch import load_file

    store = await Store.connect(store_url)
    try:
        publisher = RecordingPublisher(LocalPublisher(engine), store)
        weights = StateDictWeights(load_file(str(tiny_model / "model.safetensors")))
        v = engine.version() + 1
        assert await publisher.publish(weights, v) == v == await publisher.served()
        recorded = await store.latest_policy()
        assert recorded is not None
        assert (recorded.version, recorded.path) == (v, None)
        assert await publisher.publish(weights, v) == v  # the version served: nothing new
        assert await store.latest_policy() == recorded
    finally:
        await store.close()


# -- real processes: serve and a separate trainer, killed and started again ----------------------


def newest_policy(db: Path) -> tuple[int, str | None]:
    [row] = query(db, "SELECT version, path FROM policy_versions ORDER BY id DESC LIMIT 1")
    return int(row[0]), row[1]


def stored_config(db: Path, run_id: str) -> dict[str, Any]:
    [(config,)] = query(db, "SELECT config FROM runs WHERE id = ?", run_id)
    loaded: dict[str, Any] = json.loads(config)
    return loaded


def kill_gateway(gw: GatewayHandle) -> None:
    """SIGKILL to `rlgateway serve` and its engine process (its process group), as a crash of
    its machine would stop them."""
    port = gw.url.rsplit(":", 1)[1].encode()
    [pid] = [
        pid
        for pid, cmd in live_children(os.getpid())
        if b"serve" in cmd.split(b"\0") and port in cmd.split(b"\0")
    ]
    os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while any(p == pid for p, _ in live_children(os.getpid())):
        assert time.monotonic() < deadline, "serve outlived SIGKILL"
        time.sleep(0.05)


def assert_each_step_trained_one_batch(db: Path, steps: int, batch: int = 4) -> None:
    """Steps 1..`steps` consumed `batch` sessions each, none was dropped as stale, and at most
    one group (2 sessions) waits untrained: the one `drive` may have had admitted under the
    last version just before it saw that version (it checks, then creates). Without the run's
    eta 0 the gateway would have admitted sessions all along."""
    per_step = consumed_per_step(db)
    waiting = per_step.pop(None, 0)
    assert per_step == dict.fromkeys(range(1, steps + 1), batch)
    assert waiting in (0, 2)


def metrics_steps(tmp_path: Path) -> list[int]:
    lines = (tmp_path / "ckpt" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines]


@pytest.mark.slow
def test_a_trainer_killed_mid_run_resumes_against_the_live_gateway(
    tiny_model: Path, tmp_path: Path
) -> None:
    """eta 0 and batch_size 4 come from the trainer's config alone (the run sets neither): the
    trainer writes them to the run, and the gateway then admits exactly one batch per version,
    which is what makes the per-step counts exact."""
    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
    with run_gateway(tiny_model, tmp_path) as gw:
        db = db_path(gw)
        run_id = gw.create_run("split", {"group_size": 2})
        config = run_config(
            tmp_path,
            run=run_id,
            database_url=gw.database_url,
            model=str(tiny_model),
            eta=0,
            max_steps=3,
            lease_seconds=5,
        )
        logs = [first_log, gw.log_path]
        with trainer(config, first_log, gw.url) as first:
            wait_until(lambda: "eta" in stored_config(db, run_id), "the run's config", logs)
            assert stored_config(db, run_id)["batch_size"] == 4
            drive(gw, run_id, 2)
            wait_until(lambda: last_step(db, run_id) >= 2, "step 2 recorded", logs)
            assert first.poll() is None, first_log.read_text()
            first.send_signal(signal.SIGKILL)  # between steps: step 2 published and recorded
            first.wait()
        assert gw.client.get("/admin/version").json() == {"version": 2}

        with trainer(config, second_log, gw.url) as second:
            drive(gw, run_id, 3)
            assert second.wait(timeout=120) == 0, second_log.read_text()
        out = second_log.read_text()
        assert (
            f"training run {run_id} from step 2 to 3 (policy version 2; eta 0, batch_size 4)" in out
        ), out
        assert "Traceback" not in out, out
        assert gw.client.get("/admin/version").json() == {"version": 3}
        version, path = newest_policy(db)
        assert (version, path) == (3, str((tmp_path / "ckpt" / "published" / "v3").resolve()))
    # no trajectory trained twice nor lost: each step consumed one batch, each step ran once
    assert_each_step_trained_one_batch(db, 3)
    assert metrics_steps(tmp_path) == [1, 2, 3]


@pytest.mark.slow
def test_a_gateway_killed_while_the_trainer_runs_comes_back_at_the_newest_version(
    tiny_model: Path, tmp_path: Path
) -> None:
    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
    with contextlib.ExitStack() as trainers:
        with run_gateway(tiny_model, tmp_path) as gw:
            db = db_path(gw)
            run_id = gw.create_run("split", {"batch_size": 4, "group_size": 2, "eta": 0})
            config = run_config(
                tmp_path,
                run=run_id,
                database_url=gw.database_url,
                model=str(tiny_model),
                eta=0,
                max_steps=3,
                lease_seconds=5,
            )
            first = trainers.enter_context(trainer(config, first_log, gw.url))
            drive(gw, run_id, 2)
            # the trainer records its step after POST /admin/weights answered, which is after
            # the gateway recorded the version
            wait_until(lambda: last_step(db, run_id) >= 2, "step 2", [first_log, gw.log_path])
            kill_gateway(gw)
        assert newest_policy(db)[0] == 2
        gw.log_path.rename(tmp_path / "killed-gateway.log")

        with run_gateway(tiny_model, tmp_path) as gw:
            # right after it reports ready: the newest published policy, not the base at 0
            assert gw.client.get("/admin/version").json() == {"version": 2}
            assert "serving the newest published policy: version 2" in gw.log_path.read_text()
            # The trainer outlived its gateway; it publishes to the old address, and the test
            # harness starts the new gateway on another port: so it is restarted too.
            assert first.poll() is None, first_log.read_text()
            first.kill()
            first.wait()

            # agents are admitted again, and sample the restored policy
            r = gw.client.post(f"/runs/{run_id}/sessions", json={"count": 2, "group_id": "back"})
            assert r.status_code == 201, r.text
            for s in r.json()["sessions"]:
                key = {"Authorization": f"Bearer {s['api_key']}"}
                with httpx.Client(base_url=gw.url, headers=key, timeout=60) as agent:
                    c = agent.post(
                        f"/sessions/{s['id']}/v1/chat/completions",
                        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
                    )
                    assert c.status_code == 200, c.text
                    agent.post(f"/sessions/{s['id']}/reward", json={"reward": 0.5})
                    agent.post(f"/sessions/{s['id']}/end")
                [segment] = gw.session(s["id"])["segments"]
                assert {v for v in segment["versions"] if v >= 0} == {2}

            second = trainers.enter_context(trainer(config, second_log, gw.url))
            drive(gw, run_id, 3)
            assert second.wait(timeout=120) == 0, second_log.read_text()
            assert "from step 2 to 3" in second_log.read_text()
            assert gw.client.get("/admin/version").json() == {"version": 3}
    assert_each_step_trained_one_batch(db, 3)


@pytest.mark.slow
def test_train_refuses_a_config_the_run_disagrees_with_and_takes_the_runs_settings(
    tiny_model: Path, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'store.db'}"

    async def make_run() -> str:
        store = await Store.connect(url)
        try:
            run = await store.create_run("owned", {"eta": 2, "batch_size": 4, "group_size": 2})
            return run.id
        finally:
            await store.close()

    run_id = asyncio.run(make_run())
    db = tmp_path / "store.db"
    base = {
        "run": run_id,
        "database_url": url,
        "model": str(tiny_model),
        "max_steps": 1,
        "checkpoint_dir": str(tmp_path / "ckpt"),
        "tensorboard": False,
    }
    conflicting = tmp_path / "conflicting.yaml"
    conflicting.write_text(yaml.safe_dump({**base, "eta": 1}))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "rlgateway.cli", "train", "--config"]
    out = subprocess.run(
        [*cmd, str(conflicting)], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert "eta: the run's config says 2, --config says 1" in out.stderr
    assert stored_config(db, run_id) == {"eta": 2, "batch_size": 4, "group_size": 2}
    serve = [sys.executable, "-m", "rlgateway.cli", "serve", "--database-url", url, "--train"]
    out = subprocess.run(
        [*serve, "--config", str(conflicting)], env=env, capture_output=True, text=True, timeout=120
    )  # refused before anything loads
    assert out.returncode == 2, out.stdout + out.stderr
    assert "eta: the run's config says 2, --config says 1" in out.stderr
    assert stored_config(db, run_id) == {"eta": 2, "batch_size": 4, "group_size": 2}

    # Without eta (nor batch_size) the trainer trains by the run's. A stopped run: the trainer
    # starts, finds nothing to train and ends, having written the merged config back.
    query(db, "UPDATE runs SET status = 'stopped' WHERE id = ?", run_id)
    silent = tmp_path / "silent.yaml"
    silent.write_text(yaml.safe_dump(base))
    out = subprocess.run([*cmd, str(silent)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (
        f"training run {run_id} from step 0 to 1 (policy version 0; eta 2, batch_size 4)"
        in out.stdout
    )
    stored = stored_config(db, run_id)
    assert (stored["eta"], stored["batch_size"], stored["group_size"]) == (2, 4, 2)
    assert stored["max_steps"] == 1
    assert stored["temperature"] == 1.0
    assert "run" not in stored
    assert "database_url" not in stored
