"""A replica SIGKILLed under load loses no turn and trains nothing its client did not see.

Two `serve` replicas on one PostgreSQL database behind HAProxy; agents (the openai SDK with its
own retries) run multi-turn GRPO groups through the balancer while a separate `rlgateway train`
trains and publishes through it. Replica b is killed with SIGKILL while one of its replies is
streaming, and started again. Then:

- the streaming turn, retried as the SDK retries (`x-stainless-retry-count`), is answered by a,
  and the session holds that answer alone;
- every session's turns are one segment holding exactly the replies its client got, in order
  (each in the store once), with no prefix break, whichever replica served each turn;
- the trainer keeps training: steps with a alone, then with both again.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support.deployment import run_config, trainer, wait_until
from tests.support.fleet import Fleet, run_fleet

# one fleet (two gateways, HAProxy, agents) at a time: both modules on one worker
pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.xdist_group("fleet")]

AGENTS = 6
TURNS = 3
STEPS = 100
"""More than the test waits for: the trainer is still training when the test ends."""


@pytest.fixture(scope="module")
def fleet(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with run_fleet(tiny_model, tmp_path_factory) as fleet:
        yield fleet


class Agents:
    """`AGENTS` threads, each running groups of two sessions of `TURNS` turns until stopped."""

    def __init__(self, fleet: Fleet, run_id: str) -> None:
        self.fleet, self.run_id = fleet, run_id
        self.stop = threading.Event()
        self.seen: dict[str, list[str]] = {}
        """Per session, the ids of the replies its client got."""
        self.served_by: list[str] = []
        self.retries = 0
        self.errors: list[BaseException] = []
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(AGENTS)]

    def __enter__(self) -> Agents:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(120)

    def check(self) -> bool:
        """Raise the first error of an agent thread (a failed agent fails the test at once)."""
        if self.errors:
            raise self.errors[0]
        return True

    def _run(self, agent: int) -> None:
        try:
            with httpx.Client(base_url=self.fleet.url, headers=self.fleet.lb.headers) as admin:
                group = 0
                while not self.stop.is_set():
                    body = {"count": 2, "group_id": f"agent{agent}-{group}"}
                    r = _call(admin, "POST", f"/runs/{self.run_id}/sessions", body)
                    if r.status_code == 429:  # at the staleness bound
                        time.sleep(0.1)
                        continue
                    assert r.status_code == 201, r.text
                    group += 1
                    for s in r.json()["sessions"]:
                        self._episode(s)
        except BaseException as exc:
            self.errors.append(exc)

    def _episode(self, s: dict[str, Any]) -> None:
        agent = openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=8)
        messages: list[Any] = []
        ids = []
        for turn in range(TURNS):
            messages.append({"role": "user", "content": f"turn {turn}"})
            raw = agent.chat.completions.with_raw_response.create(
                model="tiny", messages=messages, max_tokens=8
            )
            self.served_by.append(raw.headers["X-Rlgateway-Replica"])
            self.retries += raw.retries_taken
            reply = raw.parse()
            ids.append(reply.id)
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        self.seen[s["id"]] = ids
        text = str(messages[-1]["content"] or "")
        reward = {"reward": sum(ch.islower() for ch in text) / max(len(text), 1)}
        # as the admin (PUT sets the reward, and ending is idempotent: both safe to retry)
        with httpx.Client(base_url=self.fleet.url, headers=self.fleet.lb.headers) as c:
            for method, path, payload in (
                ("PUT", f"/sessions/{s['id']}/reward", reward),
                ("POST", f"/sessions/{s['id']}/end", None),
            ):
                r = _call(c, method, path, payload)
                assert r.status_code == 200, r.text


def _call(client: httpx.Client, method: str, path: str, body: object) -> httpx.Response:
    """The request, sent again (as a client's retry would be) while the replica it reached dies
    under it: a dropped connection or the balancer's 502/503."""
    for _ in range(50):
        try:
            r = client.request(method, path, json=body)
        except httpx.TransportError:
            time.sleep(0.2)
            continue
        if r.status_code not in (502, 503):
            return r
        time.sleep(0.2)
    raise AssertionError(f"{method} {path}: no replica answered")


def _new_session(fleet: Fleet, run_id: str) -> dict[str, Any]:
    for _ in range(600):
        r = fleet.lb.post(f"/runs/{run_id}/sessions", json={"count": 1})
        if r.status_code != 429:  # at the staleness bound until the trainer's next step
            assert r.status_code == 201, r.text
            session: dict[str, Any] = r.json()["sessions"][0]
            return session
        time.sleep(0.1)
    raise AssertionError("no room for a session in a minute")


def _kill_b_while_it_streams(fleet: Fleet, run_id: str) -> tuple[str, str]:
    """Kill b while one of its replies streams; retry that turn as the SDK would. Returns the
    session and the retried reply's id."""
    question = [{"role": "user", "content": "a long answer, please"}]
    body = {"model": "tiny", "messages": question, "max_tokens": 1500, "ignore_eos": True}
    for _ in range(20):
        s = _new_session(fleet, run_id)
        url = f"{s['base_url']}/chat/completions"
        key = {"Authorization": f"Bearer {s['api_key']}"}
        with (
            httpx.Client(headers=key, timeout=60) as c,
            c.stream("POST", url, json={**body, "stream": True}) as stream,
        ):
            if fleet.replica_of(stream) != "b":
                # a's: hang up (its turn is aborted, never trained), end it, try again
                stream.close()
                assert fleet.lb.post(f"/sessions/{s['id']}/end").status_code == 200
                continue
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")
            fleet.kill("b")
            with pytest.raises(httpx.HTTPError):
                for _ in lines:
                    pass
        retry = httpx.post(
            url,
            json={**body, "max_tokens": 8},
            headers={**key, "x-stainless-retry-count": "1"},
            timeout=60,
        )
        assert retry.status_code == 200, retry.text
        assert fleet.replica_of(retry) == "a"
        assert fleet.lb.post(f"/sessions/{s['id']}/end").status_code == 200
        return s["id"], retry.json()["id"]
    raise AssertionError("the balancer never sent a stream to b")


def test_a_replica_killed_under_load_loses_no_turn(fleet: Fleet, tmp_path: Path) -> None:
    run = {"batch_size": 4, "group_size": 2, "eta": 1}
    r = fleet.lb.post("/runs", json={"name": "faults", "config": run})
    run_id = r.json()["id"]
    config = run_config(
        tmp_path, run=run_id, database_url=fleet.database_url, max_steps=STEPS, **run
    )
    log = tmp_path / "trainer.log"
    logs = [log, *(g.log_path for g in fleet.replicas.values())]

    def step() -> int:
        steps: list[int] = fleet.lb.get(f"/runs/{run_id}/metrics").json()["steps"]
        return max(steps, default=0)

    with trainer(config, log, fleet.url) as proc, Agents(fleet, run_id) as agents:
        wait_until(lambda: agents.check() and step() >= 1, "step 1", logs)
        # in a run of its own, which no staleness bound holds back
        other = fleet.lb.post("/runs", json={"name": "probe", "config": {}}).json()["id"]
        probe, retried = _kill_b_while_it_streams(fleet, other)
        killed_at = step()
        # the trainer keeps training on a alone, then on both
        wait_until(lambda: agents.check() and step() >= killed_at + 2, "steps without b", logs)
        fleet.restart("b")
        served = len(agents.served_by)
        wait_until(
            lambda: agents.check() and "b" in agents.served_by[served:], "b serves again", logs
        )
        wait_until(lambda: agents.check() and step() >= killed_at + 4, "steps with b", logs)
        assert proc.poll() is None, log.read_text()[-3000:]
    assert not agents.errors, agents.errors

    detail = fleet.lb.get(f"/sessions/{probe}").json()
    assert [seg["completion_ids"] for seg in detail["segments"]] == [[retried]], detail

    print(
        f"{len(agents.seen)} sessions, {len(agents.served_by)} turns "
        f"(a {agents.served_by.count('a')}, b {agents.served_by.count('b')}), "
        f"{agents.retries} SDK retries, killed at step {killed_at}"
    )
    assert len(agents.seen) >= 8
    for session_id, ids in agents.seen.items():
        d = fleet.lb.get(f"/sessions/{session_id}").json()
        assert d["prefix_breaks"] == 0, json.dumps(d)[:3000]
        assert [seg["completion_ids"] for seg in d["segments"]] == [ids], json.dumps(d)[:3000]
