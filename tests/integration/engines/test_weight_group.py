"""Weights over a process group (`trainer.collective`): the trainer is rank 0, the servers' workers
join, the weights are broadcast in buckets and the servers end with exactly the trainer's
tensors; a transfer that fails part-way leaves no server on mixed weights and the version goes
from disk instead; a separate `rlgateway train` publishes every step this way through a real
`rlgateway serve`, with no shared weights directory.

The fake SGLang and the fake vLLM (tests/support) receive over gloo where the real servers use
NCCL."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engines.base import (
    Broadcast,
    Engine,
    GenerateRequest,
    SamplingParams,
    TensorMeta,
    WeightGroup,
    WeightUpdate,
    collect,
)
from engines.errors import EngineUnavailableError, WeightUpdateError
from engines.router import Router
from engines.sglang import SGLangEngine, SGLangEngineConfig
from engines.vllm import VLLMEngine, VLLMEngineConfig
from rlgateway.build import build_publisher
from tests.support.deployment import drive, run_config
from tests.support.fake_sglang import FakeServer, run_fake_sglang, weights_digest
from tests.support.fake_vllm import run_fake_vllm
from tests.support.gateway_server import free_port as _free_port
from tests.support.gateway_server import run_gateway
from tests.support.live_weights import CountedWeights, LiveBucket
from tests.support.perturb import perturbed, perturbed_dir
from trainer.collective import CollectivePublisher, EngineSink
from trainer.config import TrainConfig
from trainer.publish import LocalPublisher
from trainer.weights import StateDictWeights, Weights, buckets_of, tensor_meta

pytestmark = pytest.mark.slow


def digest_of(server: FakeServer) -> dict[str, str]:
    body: dict[str, dict[str, str]] = httpx.get(f"{server.url}/fake/weights_digest").json()
    return body["digest"]


async def served_digest(server: FakeServer) -> dict[str, str]:
    async with httpx.AsyncClient() as http:
        body: dict[str, dict[str, str]] = (
            await http.get(f"{server.url}/fake/weights_digest")
        ).json()
    return body["digest"]


async def call(method: str, url: str) -> Any:
    async with httpx.AsyncClient() as http:
        return (await http.request(method, url)).json()


@contextlib.contextmanager
def sglang_and_vllm(model_dir: Path) -> Iterator[tuple[FakeServer, FakeServer]]:
    with run_fake_sglang(model_dir) as a, run_fake_vllm(model_dir) as b:
        yield a, b


@contextlib.asynccontextmanager
async def router_over(servers: tuple[FakeServer, FakeServer]) -> AsyncIterator[Router]:
    a, b = servers
    engines: list[tuple[str, Engine]] = [
        ("sglang", await SGLangEngine.connect(SGLangEngineConfig(url=a.url))),
        ("vllm", await VLLMEngine.connect(VLLMEngineConfig(url=b.url))),
    ]
    router = Router(engines, health_interval=0.2, readmit_after=1)
    router.start()
    try:
        yield router
    finally:
        await router.close()


class CountingFallback(LocalPublisher):
    """The in-process fallback, counting the versions that went through it."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self.versions: list[int] = []

    async def publish(self, weights: Weights, version: int) -> int:
        self.versions.append(version)
        return await super().publish(weights, version)


def publisher(router: Router, **knobs: Any) -> tuple[CollectivePublisher, CountingFallback]:
    """What `serve --train` builds with `publish.mode: collective` (gloo) and `knobs`."""
    fallback = CountingFallback(router)
    publish = {"mode": "collective", "backend": "gloo", "bucket_mb": 1 / 16, **knobs}
    cfg = TrainConfig(publish=publish)  # type: ignore[arg-type]
    pub = build_publisher(cfg, fallback, EngineSink(router))
    assert isinstance(pub, CollectivePublisher)
    return pub, fallback


async def receives(server: FakeServer) -> int:
    return int((await call("GET", f"{server.url}/fake/receives"))["calls"])


def test_buckets_are_bounded_and_keep_the_order() -> None:
    metas = [TensorMeta(f"t{i}", "float32", (n,)) for i, n in enumerate([10, 20, 5, 100, 1])]
    buckets = buckets_of(metas, 30 * 4)
    assert [[t.name for t in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3"], ["t4"]]
    assert [t for b in buckets for t in b] == metas
    assert len(buckets_of(metas, 1 << 20)) == 1  # the knob changes how many buckets go


async def test_sglang_and_vllm_receive_the_trainers_weights(tiny_model: Path) -> None:
    """Both servers join one gloo group (ranks 1 and 2) and end with exactly the trainer's
    tensors, twice over one group (the second version reuses it), in buckets of
    `publish.bucket_mb`: one receive call per bucket."""
    v1, v2, v3 = (perturbed(tiny_model, s) for s in (1, 2, 3))
    buckets = buckets_of([tensor_meta(n, t) for n, t in v1.items()], 64 << 10)
    assert len(buckets) > 2
    with sglang_and_vllm(tiny_model) as servers:
        async with router_over(servers) as router:
            pub, fallback = publisher(router)
            assert await EngineSink(router).group_size() == (3, False)
            LiveBucket.most = 0
            assert await pub.publish(CountedWeights(v1), 1) == 1
            # at most one bucket read ahead, one waiting and one being sent
            assert 1 <= LiveBucket.most <= 3 < len(buckets)
            sender = pub._sender
            assert router.weight_group_intact()
            for server in servers:
                assert await served_digest(server) == weights_digest(v1)
                assert await receives(server) == len(buckets)
            assert await pub.publish(StateDictWeights(v2), 2) == 2
            assert pub._sender is sender  # the group held: not formed again
            for server in servers:
                assert await served_digest(server) == weights_digest(v2)
            # the version served already: nothing goes
            assert await pub.publish(StateDictWeights(v2), 2) == 2
            assert (pub.broadcasts, fallback.versions) == (2, [])
            health = await router.health()
            assert {s.version for s in health.servers} == {2}
            info = await call("GET", f"{servers[1].url}/weight_info")
            assert info["weight_version"] == "2"
            # one bucket of 1 GiB holds the whole model: one receive call each
            whole, _ = publisher(router, bucket_mb=1024)
            assert await whole.publish(StateDictWeights(v3), 3) == 3
            for server in servers:
                assert await receives(server) == 2 * len(buckets) + 1
                assert await served_digest(server) == weights_digest(v3)


async def test_a_transfer_that_fails_part_way_goes_from_disk(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One server takes the first tensor of a bucket and fails: the broadcast fails for all
    within the group's timeout, the version is published through the fallback instead, every
    server ends on the new weights (none on a mix), and the next version forms a new group."""
    v1, v2, v3 = (perturbed(tiny_model, s) for s in (1, 2, 3))
    monkeypatch.setenv("FAKE_GROUP_TIMEOUT_S", "5")  # the servers' side of the broken broadcast
    with sglang_and_vllm(tiny_model) as servers:
        async with router_over(servers) as router:
            pub, fallback = publisher(router, timeout_s=5.0)
            assert await pub.publish(StateDictWeights(v1), 1) == 1
            await call("POST", f"{servers[0].url}/fake/fail_next_receive")
            assert await pub.publish(StateDictWeights(v2), 2) == 2
            assert fallback.versions == [2]
            assert not router.weight_group_intact()
            for server in servers:
                assert await served_digest(server) == weights_digest(v2)
            # the servers are back in rotation at version 2 (re-admitted after good probes)
            deadline = time.monotonic() + 30
            while {s.state for s in (await router.health()).servers} != {"up"}:
                assert time.monotonic() < deadline, (await router.health()).servers
                await asyncio.sleep(0.1)
            assert await pub.publish(StateDictWeights(v3), 3) == 3
            assert (pub.broadcasts, fallback.versions) == (2, [2])
            for server in servers:
                assert await served_digest(server) == weights_digest(v3)


async def test_a_failed_broadcast_leaves_the_old_weights(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No fallback follows the failed broadcast here: the router re-syncs every member from
    the last update it applied (version 1, from disk), at that same version, so the servers
    are back in rotation on whole version-1 weights; a single server on its own (no router)
    refuses requests while its weights are mixed and takes its own version again."""
    from trainer.collective import GroupSender

    v1_dir = perturbed_dir(tiny_model, tmp_path / "v1", seed=1)
    v1, v2 = perturbed(tiny_model, 1), perturbed(tiny_model, 2)
    monkeypatch.setenv("FAKE_GROUP_TIMEOUT_S", "5")
    with sglang_and_vllm(tiny_model) as servers:
        async with router_over(servers) as router:
            assert await router.update_weights(WeightUpdate(path=v1_dir)) == 1
            group = WeightGroup("127.0.0.1", _free_port(), 3, backend="gloo", timeout_s=5)
            sender, _ = await asyncio.gather(
                asyncio.to_thread(GroupSender, group), router.join_weight_group(group)
            )
            await call("POST", f"{servers[1].url}/fake/fail_next_receive")
            names = list(v2)
            update = WeightUpdate(
                broadcast=Broadcast(buckets_of([tensor_meta(n, v2[n]) for n in names], 64 << 10)),
                version=2,
            )
            sending = asyncio.create_task(asyncio.to_thread(sender.send, [v2[n] for n in names]))
            with pytest.raises(WeightUpdateError, match="broadcast of version 2 failed"):
                await router.update_weights(update)
            with contextlib.suppress(RuntimeError):  # the sender timed out: expected
                await sending
            assert router.version() == 1
            deadline = time.monotonic() + 30
            while {s.state for s in (await router.health()).servers} != {"up"}:
                assert time.monotonic() < deadline, (await router.health()).servers
                await asyncio.sleep(0.1)
            assert {s.version for s in (await router.health()).servers} == {1}
            for server in servers:
                assert await served_digest(server) == weights_digest(v1)

    with run_fake_sglang(tiny_model) as server:
        engine = await SGLangEngine.connect(SGLangEngineConfig(url=server.url))
        try:
            group = WeightGroup("127.0.0.1", _free_port(), 2, backend="gloo", timeout_s=5)
            sender, _ = await asyncio.gather(
                asyncio.to_thread(GroupSender, group), engine.join_weight_group(group)
            )
            await call("POST", f"{server.url}/fake/fail_next_receive")
            sending = asyncio.create_task(asyncio.to_thread(sender.send, [v2[n] for n in names]))
            with pytest.raises(WeightUpdateError):
                await engine.update_weights(update)
            with contextlib.suppress(RuntimeError):
                await sending
            assert engine.version() == 0
            # ignore_eos: an end token drawn first (about 1% with the tiny model) would end the
            # answer at one token, which says nothing about the weights
            sampling = SamplingParams(max_new_tokens=2, ignore_eos=True)
            with pytest.raises(EngineUnavailableError, match="failed"):
                engine.generate(GenerateRequest(prompt_ids=(1, 2, 3), sampling=sampling))
            # its own version again, from whole weights: it serves again
            assert await engine.update_weights(WeightUpdate(path=v1_dir, version=0)) == 0
            r = await collect(engine, GenerateRequest(prompt_ids=(1, 2, 3), sampling=sampling))
            assert len(r.token_ids) == 2
            assert await served_digest(server) == weights_digest(v1)
        finally:
            await engine.close()


async def test_a_server_that_cannot_join_sends_the_version_from_disk(tiny_model: Path) -> None:
    """`publish.master_address` is where the servers reach the trainer: one they cannot reach
    means no group is formed; the join ends at `publish.timeout_s` and the version still
    reaches every server, from disk."""
    v1 = perturbed(tiny_model, 1)
    with sglang_and_vllm(tiny_model) as servers:
        async with router_over(servers) as router:
            # TEST-NET-1: nothing answers there
            pub, fallback = publisher(router, timeout_s=3.0, master_address="192.0.2.1")
            start = time.monotonic()
            assert await pub.publish(StateDictWeights(v1), 1) == 1
            assert time.monotonic() - start >= 3.0  # the servers had the whole timeout to join
            assert (pub.broadcasts, fallback.versions) == (0, [1])
            for server in servers:
                assert await served_digest(server) == weights_digest(v1)


def test_a_separate_trainer_publishes_over_the_group(tiny_model: Path, tmp_path: Path) -> None:
    """`rlgateway serve` over two SGLang servers and `rlgateway train` with `publish.mode:
    collective`: every step reaches both servers over the group, nothing is written under the
    published directory, and the servers end with the trainer's final weights."""
    from safetensors.torch import load_file

    from trainer.export import find_checkpoint, read_weights

    with run_fake_sglang(tiny_model) as a, run_fake_sglang(tiny_model) as b:
        args = ["--engine", "sglang", "--engine-url", a.url, "--engine-url", b.url]
        with run_gateway(tiny_model, tmp_path, extra_args=args) as gw:
            check_bad_requests(gw.client)
            run_id = gw.create_run("group", {"batch_size": 4, "group_size": 2, "eta": 1})
            config = run_config(
                tmp_path, run=run_id, database_url=gw.database_url, model=str(tiny_model)
            )
            cmd = [sys.executable, "-m", "rlgateway.cli", "train", "--config", str(config),
                   "--gateway-url", gw.url, "--admin-token", gw.admin_token,
                   "publish.mode=collective", "publish.backend=gloo",
                   "publish.timeout_s=60"]  # fmt: skip
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            log = tmp_path / "trainer.log"
            with log.open("w") as out:
                trainer = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
                try:
                    drive(gw, run_id, 2)
                    assert trainer.wait(timeout=120) == 0, log.read_text()
                finally:
                    if trainer.poll() is None:
                        trainer.kill()
                        trainer.wait()
            assert gw.client.get("/admin/version").json() == {"version": 2}
            group = gw.client.get("/admin/weights/group").json()
            assert group == {"world_size": 3, "intact": True}
        text = log.read_text()
        assert "formed the weight group: 3 ranks" in text, text
        assert "did not reach the servers" not in text, text
        assert not (tmp_path / "ckpt" / "published").exists()
        final = read_weights(find_checkpoint(tmp_path / "ckpt"))
        assert digest_of(a) == digest_of(b) == weights_digest(final)
        assert digest_of(a) != weights_digest(load_file(str(tiny_model / "model.safetensors")))


def check_bad_requests(admin: httpx.Client) -> None:
    """What the weight-group routes answer before any group exists, and to bodies they refuse:
    each a clear OpenAI-shaped error that changes nothing."""
    one = [[{"name": "model.norm.weight", "dtype": "float32", "shape": [8]}]]
    assert admin.get("/admin/weights/group").json() == {"world_size": 3, "intact": False}
    r = admin.post("/admin/weights/broadcast", json={"buckets": one})
    assert r.status_code == 409, r.text
    assert "formed again" in r.json()["error"]["message"]
    group = {"master_address": "127.0.0.1", "master_port": 1, "world_size": 5, "timeout_s": 5}
    r = admin.post("/admin/weights/group", json=group)
    assert r.status_code == 409, r.text
    assert "has 5 ranks" in r.json()["error"]["message"]
    bad_dtype = [[{"name": "w", "dtype": "complex128", "shape": [2]}]]
    for body, status in (
        ({"buckets": bad_dtype}, 422),
        ({"buckets": []}, 422),
        ({"buckets": [[]]}, 400),
        ({"buckets": one, "version": -3}, 400),
        ({**group, "world_size": 1}, 422),
    ):
        route = "/admin/weights/group" if "world_size" in body else "/admin/weights/broadcast"
        r = admin.post(route, json=body)
        assert r.status_code == status, (body, r.text)
        assert r.json()["error"]["message"]
    r = admin.post("/admin/weights/broadcast", json={"buckets": one, "version": 0})
    assert r.json() == {"version": 0, "changed": False}  # the version served: a no-op
    assert admin.get("/admin/version").json() == {"version": 0}


def test_serve_train_broadcasts_into_its_servers(tiny_model: Path, tmp_path: Path) -> None:
    """`serve --train` with `publish.mode: collective` over two SGLang servers: the in-process
    trainer is rank 0 and every step reaches both servers over the group."""
    from tests.support.deployment import STEPS

    with run_fake_sglang(tiny_model) as a, run_fake_sglang(tiny_model) as b:
        config = run_config(tmp_path, publish={"mode": "collective", "backend": "gloo"})
        args = ["--train", "--config", str(config), "--engine", "sglang"]
        args += ["--engine-url", a.url, "--engine-url", b.url]
        with run_gateway(tiny_model, tmp_path, extra_args=args, timeout=240) as gw:
            drive(gw, gw.trained_run(), STEPS)
            assert gw.client.get("/admin/version").json() == {"version": STEPS}
            log = gw.log_path.read_text()
        for server in (a, b):
            info = httpx.get(f"{server.url}/model_info", timeout=10).json()
            assert info["weight_version"] == str(STEPS)
            assert int(httpx.get(f"{server.url}/fake/receives").json()["calls"]) >= STEPS
        assert digest_of(a) == digest_of(b)
    assert "did not reach the servers" not in log, log
