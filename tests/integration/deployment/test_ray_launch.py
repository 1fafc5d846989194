"""`rlgateway launch SPEC --ray ADDRESS` on a Ray cluster of three nodes on this machine (a head
and two workers, `tests/support/ray_cluster.py`), the real PostgreSQL, the tiny model on the
gateways' local engines or on vLLM's command line played by the faithful fake: the topology
comes up where the spec's resources put it (the trainer's torchrun on two nodes), a GRPO run
trains and publishes to both replicas, a killed gateway actor, a killed engine server and a
killed trainer come back (the server re-synced, the trainer from its checkpoint), a relaunch
trains the same run, and nothing is left running when the launch ends: the trainer finished,
the launch was told to stop, or a part ran out of restarts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.store_fixtures import create_postgres_database, drop_postgres_database
from tests.support.paths import REPO_ROOT
from tests.support.procs import group_members
from tests.support.ray_cluster import ray_cluster

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

TOKEN = "launch-admin"
STEPS = 3


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    with ray_cluster() as address:
        yield address


@pytest.fixture
def database_url() -> Iterator[str]:
    """A database of its own for each launch: the policy a fleet serves is its database's."""
    url = create_postgres_database()
    yield url
    drop_postgres_database(url)


def write_spec(tmp_path: Path, database_url: str, name: str, **sections: Any) -> Path:
    spec = {
        "name": name,
        "database_url": database_url,
        "work_dir": str(tmp_path / "work"),
        "gateways": {
            "replicas": 2,
            "resources": {"CPU": 0.5, "replica_slot": 1},
            "args": ["--device", "cpu", "--log-level", "warning"],
            "env": {"OMP_NUM_THREADS": "1", "RLGATEWAY_POLICY_POLL_SECONDS": "0.3"},
        },
        "trainer": {
            "resources": {"CPU": 0.5, "trainer_slot": 1},
            "env": {"OMP_NUM_THREADS": "1"},
            "config": {
                "batch_size": 4,
                "group_size": 2,
                "eta": 1,
                "max_steps": STEPS,
                "optim": {"lr": 1e-3},
                "tensorboard": False,
            },
        },
    }
    spec = merged(spec, sections)
    path = tmp_path / "launch.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def merged(base: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in more.items():
        old = out.get(key)
        both = isinstance(old, dict) and isinstance(value, dict)
        out[key] = merged(old, value) if both else value
    return out


class Launch:
    def __init__(self, spec: Path, address: str, *overrides: str) -> None:
        self.work = Path(yaml.safe_load(spec.read_text())["work_dir"])
        self.log = spec.parent / "launch.log"
        cmd = [sys.executable, "-m", "rlgateway.cli", "launch", str(spec), "--ray", address]
        env = {**os.environ, "RLGATEWAY_ADMIN_TOKEN": TOKEN, "RAY_USAGE_STATS_ENABLED": "0"}
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [*cmd, *overrides], stdout=out, stderr=subprocess.STDOUT, env=env,
                cwd=REPO_ROOT, start_new_session=True,
            )  # fmt: skip

    def state(self) -> dict[str, Any]:
        path = self.work / "launch.json"
        loaded: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
        return loaded

    def wait(self, done: Callable[[dict[str, Any]], bool], what: str, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while not done(self.state()):
            assert self.proc.poll() is None, f"the launch exited: {self.log.read_text()}"
            assert time.monotonic() < deadline, f"{what}: {self.log.read_text()}"
            time.sleep(0.2)

    def urls(self) -> list[str]:
        return [g["url"] for g in self.state()["gateways"]]

    def version(self, url: str) -> int:
        r = httpx.get(f"{url}/admin/version", headers=ADMIN, timeout=30)
        r.raise_for_status()
        version: int = r.json()["version"]
        return version

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


ADMIN = {"Authorization": f"Bearer {TOKEN}"}


def up(state: dict[str, Any]) -> bool:
    return bool(state.get("trainer")) and all(g.get("url") for g in state["gateways"])


def drive(launch: Launch, until: int, timeout: float = 300) -> int:
    """GRPO groups of two made on one replica and played on the other, until the first replica
    serves version `until`; returns how many groups."""
    deadline, g = time.monotonic() + timeout, 0
    run_id = launch.state()["run_id"]
    while launch.version(launch.urls()[0]) < until:
        assert time.monotonic() < deadline, launch.log.read_text()
        urls = launch.urls()
        r = httpx.post(f"{urls[g % len(urls)]}/runs/{run_id}/sessions", headers=ADMIN, timeout=60,
                       json={"count": 2, "group_id": f"g{time.monotonic_ns()}"})  # fmt: skip
        if r.status_code == 429:  # at the staleness bound: the trainer is behind
            time.sleep(0.2)
            continue
        assert r.status_code == 201, r.text
        g += 1
        for s in r.json()["sessions"]:
            url, key = urls[(g + 1) % len(urls)], {"Authorization": f"Bearer {s['api_key']}"}
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
            c = httpx.post(f"{url}/sessions/{s['id']}/v1/chat/completions", headers=key,
                           json=body, timeout=60)  # fmt: skip
            assert c.status_code == 200, c.text
            text = c.json()["choices"][0]["message"]["content"] or ""
            reward = sum(ch.islower() for ch in text) / 8
            assert httpx.post(f"{url}/sessions/{s['id']}/reward", headers=key,
                              json={"reward": reward}).status_code == 200  # fmt: skip
            assert httpx.post(f"{url}/sessions/{s['id']}/end", headers=key).status_code == 200
    return g


def gone(pids: list[int], timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while any(group_members(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def test_a_launched_topology_trains_comes_back_from_kills_and_leaves_nothing(
    cluster: str, database_url: str, tmp_path: Path
) -> None:
    # the trainer: torchrun on two nodes of a placement group, one rank each, FSDP over both
    two_nodes = {"nnodes": 2, "config": {"backend": "fsdp:d2"}}
    spec = write_spec(tmp_path, database_url, "trained", trainer=two_nodes)
    launch = Launch(spec, cluster)
    try:
        launch.wait(up, "the topology up")
        state = launch.state()
        nodes = [g["node_id"] for g in state["gateways"]]
        assert len(set(nodes)) == 2  # one replica per worker node (replica_slot)
        assert len({t["node_id"] for t in state["trainer"]}) == 2  # spread (trainer_slot)

        drive(launch, 1)
        # a gateway replica's actor dies: it comes back at its address, on the newest policy
        old = launch.state()["gateways"][1]
        os.kill(old["actor_pid"], signal.SIGKILL)
        launch.wait(lambda s: s["gateways"][1]["restarts"] == 1 and s["gateways"][1]["pid"]
                    != old["pid"], "gateway-1 restarted")  # fmt: skip
        assert gone([old["pid"]])  # the killed actor's gateway and its engine went with it
        new = launch.state()["gateways"][1]
        assert new["url"] == old["url"]
        assert new["node_id"] == old["node_id"]
        assert launch.version(new["url"]) == launch.version(launch.urls()[0]) >= 1

        # the trainer is killed: it comes back and resumes from its newest checkpoint
        trainer = launch.state()["trainer"][0]
        os.killpg(trainer["pid"], signal.SIGKILL)
        launch.wait(lambda s: s["trainer_restarts"] == 1 and s["trainer"][0]["pid"]
                    != trainer["pid"], "the trainer restarted")  # fmt: skip
        drive(launch, STEPS)
        assert launch.proc.wait(timeout=120) == 0, launch.log.read_text()
    finally:
        launch.stop()
    log = launch.log.read_text()
    assert "the trainer finished run" in log, log
    assert "every part is stopped" in log, log
    state = launch.state()
    assert state["stopped"]
    assert state["trainer_restarts"] == 1
    pids = [p["pid"] for p in state["gateways"] + state["trainer"]]
    assert gone(pids), "processes left behind"
    ckpt = tmp_path / "work" / "checkpoints"
    assert (ckpt / f"step-{STEPS:06d}").is_dir(), sorted(p.name for p in ckpt.iterdir())


def test_a_stopped_launch_leaves_nothing_and_launching_again_trains_the_same_run(
    cluster: str, database_url: str, tmp_path: Path
) -> None:
    spec = write_spec(tmp_path, database_url, "relaunched")
    first = Launch(spec, cluster)
    try:
        first.wait(up, "the first launch up")
        run_id = first.state()["run_id"]
        os.kill(first.proc.pid, signal.SIGTERM)
        assert first.proc.wait(timeout=120) == 128 + signal.SIGTERM, first.log.read_text()
    finally:
        first.stop()
    state = first.state()
    assert state["stopped"]
    assert gone([p["pid"] for p in state["gateways"] + state["trainer"]])

    # again, with no restart allowed: the same run, and a lost replica ends the launch
    again = Launch(spec, cluster, "trainer.config.max_steps=5", "restarts=0")
    try:
        again.wait(lambda s: up(s) and s.get("stopped") is False, "the second launch up")
        assert again.state()["run_id"] == run_id
        os.kill(again.state()["gateways"][0]["actor_pid"], signal.SIGKILL)
        code = again.proc.wait(timeout=120)
    finally:
        again.stop()
    assert code == 2, again.log.read_text()
    assert "gateway-0 lost and has no restart left (0)" in again.log.read_text()
    state = again.state()
    assert state["stopped"]
    assert gone([p["pid"] for p in state["gateways"] + state["trainer"]])

    # the launcher itself SIGKILLed: Ray ends its actors, and with them everything they ran
    last = Launch(spec, cluster)
    try:
        last.wait(lambda s: up(s) and s.get("stopped") is False, "the third launch up")
    finally:
        last.stop()
    state = last.state()
    assert not state["stopped"]
    assert gone([p["pid"] for p in state["gateways"] + state["trainer"]], timeout=60)


def test_a_replicas_engine_servers_are_launched_for_it_and_one_killed_is_resynced(
    cluster: str, database_url: str, tmp_path: Path
) -> None:
    """vLLM's command line, played by the faithful fake (real generation, weight updates)."""
    fake = REPO_ROOT / "tests" / "support" / "fake_vllm_server_pkg"
    engines = {"kind": "vllm", "per_gateway": 2, "python": sys.executable,
               "resources": {"CPU": 0.25},
               "env": {"PYTHONPATH": f"{fake}:{REPO_ROOT}"}}  # fmt: skip
    spec = write_spec(tmp_path, database_url, "engines", gateways={"replicas": 1}, engines=engines)
    launch = Launch(spec, cluster)
    try:
        launch.wait(up, "the topology up")
        servers = launch.state()["engines"]
        assert [e["name"] for e in servers] == ["engine-0-0", "engine-0-1"]
        drive(launch, 1)
        old = servers[1]
        os.kill(old["actor_pid"], signal.SIGKILL)
        launch.wait(lambda s: s["engines"][1]["restarts"] == 1 and s["engines"][1]["pid"]
                    != old["pid"], "engine-0-1 restarted")  # fmt: skip
        assert gone([old["pid"]])
        assert launch.state()["engines"][1]["url"] == old["url"]  # the replica's URL holds
        # the replica's router re-syncs the new server to the policy it serves (no more than
        # two steps' sessions were admitted, so the trainer waits for the third's)
        deadline, served = time.monotonic() + 120, str(launch.version(launch.urls()[0]))
        while httpx.get(f"{old['url']}/weight_info").json()["weight_version"] != served:
            assert time.monotonic() < deadline, launch.log.read_text()
            time.sleep(0.2)
        drive(launch, STEPS)
        assert launch.proc.wait(timeout=120) == 0, launch.log.read_text()
    finally:
        launch.stop()
    state = launch.state()
    assert gone([p["pid"] for p in state["gateways"] + state["engines"] + state["trainer"]])
    with pytest.raises(httpx.TransportError):  # the launch stopped every server at its end
        httpx.get(f"{old['url']}/health", timeout=5)
