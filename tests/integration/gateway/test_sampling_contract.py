"""The sampling contract (`store.run_config`) through the real gateway (in-process over ASGI, local
engine, SQLite and PostgreSQL stores): a session's request samples under its run's config, the
turn's record holds the settings the engine really used (checked through behaviour: the recorded
logprobs are the trainer's teacher-forced ones at the recorded temperature), every answer names
its contract in `x-rlgateway-sampling`, and each segment exposes its turns' settings."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engines.local import LocalEngine
from gateway.run_configs import RunConfigs
from gateway.settings import GatewaySettings
from rlgateway.app import create_app
from store import Store
from store.errors import NotFoundError
from store.run_config import SAMPLING_HEADER
from store.types import JSON, Segment
from tests.store_fixtures import store_url  # noqa: F401
from tests.support.components import tiny_components
from tests.support.teacher import teacher_forced
from tests.support.workers.fsdp_worker import build_backend

ADMIN = {"Authorization": "Bearer admin-token"}
USER = [{"role": "user", "content": "hello"}]
PARITY = 1e-5
"""How far a recorded behaviour logprob may lie from the trainer's at its temperature."""


@pytest.fixture(scope="module")
def teacher(tiny_model: Path) -> Any:
    """The trainer's backend on the engine's weights (for teacher-forced logprobs)."""
    return build_backend(tiny_model)


class Client:
    def __init__(self, http: httpx.AsyncClient, store: Store, db_path: Path | None) -> None:
        self.http = http
        self.store = store
        self.db_path = db_path

    async def session(self, config: JSON) -> dict[str, Any]:
        """A new session of a new run with `config`."""
        run = await self.http.post("/runs", json={"name": "t", "config": config}, headers=ADMIN)
        assert run.status_code == 201, run.text
        out = await self.http.post(
            f"/runs/{run.json()['id']}/sessions", json={"count": 1}, headers=ADMIN
        )
        assert out.status_code == 201, out.text
        session: dict[str, Any] = out.json()["sessions"][0]
        return session

    async def chat(
        self, s: dict[str, Any], messages: list[dict[str, Any]], **kw: Any
    ) -> httpx.Response:
        body = {"messages": messages, "max_tokens": 8, "seed": 0, **kw}
        r = await self.http.post(
            f"/sessions/{s['id']}/v1/chat/completions", json=body, headers=key(s)
        )
        assert r.status_code == 200, r.text
        return r

    async def segments(self, s: dict[str, Any]) -> list[Segment]:
        return (await self.store.session_detail(s["id"])).segments

    async def records(self, s: dict[str, Any]) -> list[JSON]:
        """The session's turns' sampling records, in turn order."""
        return [r for seg in await self.segments(s) for r in seg.turn_sampling]


def key(s: dict[str, Any]) -> dict[str, str]:
    return {"Authorization": f"Bearer {s['api_key']}"}


async def _client(engine: LocalEngine, tiny_model: Path, url: str) -> AsyncIterator[Client]:
    store = await Store.connect(url)
    components = tiny_components(engine, store, tiny_model)
    app = create_app(GatewaySettings(admin_token="admin-token"), components)
    db_path = Path(url.removeprefix("sqlite:///")) if url.startswith("sqlite") else None
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=60) as h:
            yield Client(h, store, db_path)
    await store.close()


@pytest.fixture
async def client(engine: LocalEngine, tiny_model: Path, tmp_path: Path) -> AsyncIterator[Client]:
    async for c in _client(engine, tiny_model, f"sqlite:///{tmp_path / 'gw.db'}"):
        yield c


@pytest.fixture
async def any_store_client(
    engine: LocalEngine,
    tiny_model: Path,
    store_url: str,  # noqa: F811
) -> AsyncIterator[Client]:
    """The gateway on each store backend (SQLite, PostgreSQL)."""
    async for c in _client(engine, tiny_model, store_url):
        yield c


def behaviour_gap(teacher: Any, seg: Segment, temperatures: list[float]) -> float:
    """The largest gap between a sampled token's recorded logprob and the trainer's teacher-
    forced one at `temperatures[i]`, the temperature turn i is checked against."""
    assert len(temperatures) == len(seg.turn_spans)
    gap = 0.0
    for t, (a, b) in zip(temperatures, seg.turn_spans, strict=True):
        forced = teacher_forced(teacher, seg.tokens, t)
        gap = max(gap, *(abs(seg.logprobs[i] - forced[i]) for i in range(a, b)))
    return gap


def assert_sampled_at(teacher: Any, seg: Segment, temperatures: list[float]) -> None:
    """The engine really sampled turn i at `temperatures[i]`: its behaviour logprobs are the
    trainer's at that temperature, and not those at temperature 0.5 higher (so this can fail)."""
    assert behaviour_gap(teacher, seg, temperatures) <= PARITY
    assert behaviour_gap(teacher, seg, [t + 0.5 for t in temperatures]) > 1e-3


async def test_a_request_without_temperature_samples_at_the_runs(
    client: Client, teacher: Any
) -> None:
    s = await client.session({"temperature": 0.7})
    r = await client.chat(s, USER)
    assert r.headers[SAMPLING_HEADER] == "record"
    [record] = await client.records(s)
    assert record["temperature"] == 0.7
    assert record["contract"] == "record"
    assert (record["top_p"], record["top_k"], record["min_new_tokens"]) == (1.0, 0, 0)
    [seg] = await client.segments(s)
    assert_sampled_at(teacher, seg, [0.7])


async def test_under_contract_record_the_clients_temperature_is_honoured(
    client: Client, teacher: Any
) -> None:
    s = await client.session({"temperature": 0.7})
    r = await client.chat(s, USER, temperature=0.9)
    assert r.headers[SAMPLING_HEADER] == "record"
    [record] = await client.records(s)
    assert (record["temperature"], record["contract"]) == (0.9, "record")
    [seg] = await client.segments(s)
    assert_sampled_at(teacher, seg, [0.9])


async def test_under_contract_run_the_client_cannot_change_sampling(
    client: Client, teacher: Any
) -> None:
    s = await client.session({"temperature": 0.7, "client_sampling": "run"})
    r = await client.chat(s, USER, temperature=0.3, top_p=0.5, top_k=3, min_tokens=2)
    assert r.headers[SAMPLING_HEADER] == "run"
    [record] = await client.records(s)
    assert record["contract"] == "run"
    assert record["temperature"] == 0.7
    assert (record["top_p"], record["top_k"], record["min_new_tokens"]) == (1.0, 0, 0)
    assert (record["seed"], record["max_new_tokens"]) == (0, 8)  # what does not bias is kept
    [seg] = await client.segments(s)
    assert_sampled_at(teacher, seg, [0.7])


async def _generate(
    client: Client, route: str, headers: dict[str, str], stream: bool, prefix: str = ""
) -> httpx.Response:
    """One request of `route` (chat or completions) read to its end."""
    body: JSON = {"max_tokens": 4, "seed": 1, "temperature": 0.3, "stream": stream}
    if route == "chat":
        body["messages"] = USER
    else:
        body["prompt"] = "hello"
    path = "chat/completions" if route == "chat" else "completions"
    async with client.http.stream("POST", f"{prefix}/v1/{path}", json=body, headers=headers) as r:
        text = (await r.aread()).decode()
    assert r.status_code == 200, text
    if stream:
        assert r.headers["content-type"].startswith("text/event-stream")
        assert text.rstrip().endswith("data: [DONE]")
    else:
        assert json.loads(text)["choices"]
    return r


@pytest.mark.parametrize("contract", ["record", "run"])
async def test_every_answer_names_its_contract(client: Client, contract: str) -> None:
    s = await client.session({"temperature": 0.7, "client_sampling": contract})
    prefix = f"/sessions/{s['id']}"
    for route in ("chat", "completions"):
        for stream in (False, True):
            r = await _generate(client, route, key(s), stream, prefix)
            assert r.headers[SAMPLING_HEADER] == contract, (route, stream)
    records = await client.records(s)
    assert len(records) == 4
    assert {r["contract"] for r in records} == {contract}
    assert {r["temperature"] for r in records} == {0.3 if contract == "record" else 0.7}
    # a session key on the plain /v1 routes is that session: its run's contract too
    r = await _generate(client, "chat", key(s), False)
    assert r.headers[SAMPLING_HEADER] == contract
    # the admin's unrecorded calls belong to no run: contract record
    for route in ("chat", "completions"):
        for stream in (False, True):
            r = await _generate(client, route, ADMIN, stream)
            assert r.headers[SAMPLING_HEADER] == "record", (route, stream)
    assert len(await client.records(s)) == 5


async def test_segments_expose_each_turns_sampling_in_order(
    any_store_client: Client, teacher: Any
) -> None:
    client = any_store_client
    s = await client.session({"temperature": 0.7})
    first = await client.chat(s, USER)  # the run's temperature
    messages = [*USER, first.json()["choices"][0]["message"], {"role": "user", "content": "more"}]
    await client.chat(s, messages, temperature=1.0, seed=1)
    [seg] = await client.segments(s)
    assert len(seg.turn_sampling) == len(seg.completion_ids) == 2
    assert [r["temperature"] for r in seg.turn_sampling] == [0.7, 1.0]
    assert [r["contract"] for r in seg.turn_sampling] == ["record", "record"]
    assert_sampled_at(teacher, seg, [0.7, 1.0])
    # the trainer's view (ended, rewarded, claimed) carries the same records
    await client.http.post(f"/sessions/{s['id']}/reward", json={"reward": 1.0}, headers=key(s))
    await client.http.post(f"/sessions/{s['id']}/end", headers=key(s))
    [traj] = await client.store.list_trainable(s["run_id"])
    assert [r["temperature"] for r in traj.segments[0].turn_sampling] == [0.7, 1.0]


async def test_run_configs_are_read_once_per_ttl(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gateway's cache: concurrent requests of a run read its config once; a change written
    by another process is seen once the entry's `ttl` has passed, not before."""
    s = await client.session({"temperature": 0.7})
    reads: list[str] = []
    get_run = client.store.get_run

    async def counted(run_id: str) -> Any:
        reads.append(run_id)
        return await get_run(run_id)

    monkeypatch.setattr(client.store, "get_run", counted)
    now = [0.0]
    configs = RunConfigs(client.store, ttl=5.0, clock=lambda: now[0])
    got = await asyncio.gather(*(configs.of(s["run_id"]) for _ in range(20)))
    assert {c.temperature for c in got} == {0.7}
    assert len(reads) == 1
    assert client.db_path is not None
    with sqlite3.connect(client.db_path) as db:  # another process changes the stored config
        db.execute(
            "UPDATE runs SET config = ? WHERE id = ?",
            (json.dumps({"temperature": 0.4}), s["run_id"]),
        )
    now[0] = 4.9
    assert (await configs.of(s["run_id"])).temperature == 0.7
    now[0] = 5.1
    assert (await configs.of(s["run_id"])).temperature == 0.4
    assert len(reads) == 2
    # a run that does not exist is not cached: each ask reads again, and fails
    for _ in range(2):
        with pytest.raises(NotFoundError):
            await configs.of("run_nope")
    assert reads[2:] == ["run_nope", "run_nope"]


async def _episode(client: Client, run_id: str, turns: list[JSON]) -> None:
    """One session of `run_id`: a chat turn per entry of `turns` (its sampling settings), each
    extending the last; then rewarded and ended."""
    r = await client.http.post(f"/runs/{run_id}/sessions", json={"count": 1}, headers=ADMIN)
    assert r.status_code == 201, r.text
    s = r.json()["sessions"][0]
    messages = list(USER)
    for i, settings in enumerate(turns):
        reply = await client.chat(s, messages, seed=i, **settings)
        messages += [reply.json()["choices"][0]["message"], {"role": "user", "content": f"{i}"}]
    [seg] = await client.segments(s)  # multi-turn, one segment
    assert len(seg.completion_ids) == len(turns)
    await client.http.post(f"/sessions/{s['id']}/reward", json={"reward": 1.0}, headers=key(s))
    await client.http.post(f"/sessions/{s['id']}/end", headers=key(s))


async def test_the_trainer_reproduces_turns_of_mixed_temperatures(
    client: Client, tiny_model: Path, tmp_path: Path
) -> None:
    """A session of a `record` run with turns at 0.7 (the run's) and 1.0 is trained on-policy:
    with one mini-batch and decoupled PPO the trainer's logprobs equal the behaviour logprobs of
    both temperatures (importance weights 1), and a turn at top_p 0.5, which it cannot
    reproduce, is left out of the loss and counted."""
    from trainer.backends.registry import build_backend as build_policy
    from trainer.config import TrainConfig
    from trainer.loop import Trainer

    run = await client.http.post(
        "/runs", json={"name": "t", "config": {"temperature": 0.7}}, headers=ADMIN
    )
    assert run.status_code == 201, run.text
    run_id = run.json()["id"]
    await _episode(client, run_id, [{}, {"temperature": 1.0}])
    await _episode(client, run_id, [{}, {"temperature": 1.0}, {"top_p": 0.5}])
    mixed, truncated = await client.store.list_trainable(run_id)
    assert len(truncated.segments[0].completion_ids) == 3
    cfg = TrainConfig.model_validate(
        {
            "run": run_id,
            "database_url": "sqlite:///unused",
            "checkpoint_dir": str(tmp_path / "ckpt"),
            "tensorboard": False,
            "temperature": 0.7,
            "algo": {"ppo_n_minibatches": 1, "decoupled": True},
            "optim": {"lr": 1e-9},
        }
    )
    backend = build_policy(cfg.backend_config(str(tiny_model)))
    trainer = Trainer(cfg, client.store, backend, None)
    for traj, untrainable in ((mixed, 0), (truncated, 1)):
        done = await trainer.update([traj])
        assert done.built.untrainable_turns == untrainable
        stats = done.stats
        for name in ("ratio_min", "ratio_max", "imp_weight_min", "imp_weight_max"):
            assert stats[name] == pytest.approx(1.0, abs=PARITY), (name, stats)
