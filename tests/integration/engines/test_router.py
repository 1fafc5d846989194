"""The router over real HTTP servers (fake SGLang servers generating with the tiny model):
placement, affinity, ejection and re-admission, retry and mid-generation failure, coordinated
weight updates, the gateway's 503 when a server dies mid-generation, and a server that missed an
update brought back to the current version (re-synced) before it serves again."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from engines.base import (
    FinishReason,
    GenerateRequest,
    SamplingParams,
    ServerState,
    WeightUpdate,
    collect,
)
from engines.errors import EngineUnavailableError
from engines.router import Router
from engines.sglang import SGLangEngine, SGLangEngineConfig
from tests.support.fake_sglang import FakeServer, run_fake_sglang
from tests.support.gateway_server import run_gateway

pytestmark = pytest.mark.slow

PROMPT = (1, 5, 9, 20, 30)
LONG = SamplingParams(max_new_tokens=800, ignore_eos=True)


@pytest.fixture
def two(tiny_model: Path) -> Iterator[tuple[FakeServer, FakeServer]]:
    with run_fake_sglang(tiny_model) as a, run_fake_sglang(tiny_model) as b:
        yield a, b


async def router_over(*servers: FakeServer, **kwargs: float) -> Router:
    engines = [await SGLangEngine.connect(SGLangEngineConfig(url=s.url)) for s in servers]
    return Router(
        [(s.url, e) for s, e in zip(servers, engines, strict=True)],
        health_interval=0.1,
        **kwargs,  # type: ignore[arg-type]
    )


def req(session: str | None = None, sampling: SamplingParams = LONG) -> GenerateRequest:
    if session is None:
        return GenerateRequest(prompt_ids=PROMPT, sampling=sampling)
    import uuid

    return GenerateRequest(
        prompt_ids=PROMPT, sampling=sampling, request_id=f"{session}/{uuid.uuid4().hex}"
    )


async def test_placement_affinity_update_and_failures(
    two: tuple[FakeServer, FakeServer], tiny_model: Path, tmp_path: Path
) -> None:
    a, b = two
    router = await router_over(a, b)
    router.start()
    ba, bb = router.backends
    try:
        # Least outstanding: four concurrent requests spread two and two.
        tasks = [asyncio.create_task(collect(router, req())) for _ in range(4)]
        while ba.outstanding + bb.outstanding < 4:
            await asyncio.sleep(0.01)
        assert (ba.outstanding, bb.outstanding) == (2, 2)

        # A coordinated weight update while they run: one version on both servers, and every
        # in-flight request completes with version 0 then version 1.
        new = tmp_path / "v1"
        shutil.copytree(tiny_model, new)
        assert await router.update_weights(WeightUpdate(path=new)) == 1
        results = await asyncio.gather(*tasks)
        for r in results:
            assert len(r.token_ids) == 800
            assert r.versions[0] == 0
            assert r.versions[-1] == 1
        assert [b.engine.version() for b in router.backends] == [1, 1]
        async with httpx.AsyncClient() as http:
            for s in (a, b):
                info = (await http.get(f"{s.url}/model_info")).json()
                assert info["weight_version"] == "1"

        # Session affinity: a session stays on its server even when the other is idler.
        short = SamplingParams(max_new_tokens=4, ignore_eos=True)
        first = router.pick(req("s1", short))
        busy = asyncio.create_task(collect(router, req("s1")))
        while first.outstanding == 0:
            await asyncio.sleep(0.01)
        assert router.pick(req("s1", short)) is first
        assert router.pick(req(None, short)) is not first
        await busy

        # Server b dies. A request pinned to it (affinity) fails before any token: retried on a.
        # A new session goes to the server with fewer requests in flight: b, while s1 is busy on
        # a (ties go by the servers' last reported load, which the test does not control).
        pinned = "s1"
        if first is not bb:
            hold = asyncio.create_task(collect(router, req("s1")))
            while first.outstanding == 0:
                await asyncio.sleep(0.01)
            pinned = "on-b"
            assert router.pick(req(pinned, short)) is bb
            await hold
        b.kill()
        r = await collect(router, req(pinned, short))
        assert len(r.token_ids) == 4
        assert not bb.healthy  # ejected by the failure
        health = await router.health()
        assert health.ok
        assert [(x.name, x.state) for x in health.servers] == [(a.url, "up"), (b.url, "down")]
    finally:
        await router.close()


async def test_death_mid_generation_is_an_error_then_ejection_and_readmission(
    two: tuple[FakeServer, FakeServer], tiny_model: Path
) -> None:
    a, b = two
    router = await router_over(a, b, eject_after=1, readmit_after=2)
    router.start()
    ba, _ = router.backends
    try:
        request = req()
        assert router.pick(request) is ba
        got: list[int] = []

        async def consume_and_kill_a() -> None:
            async for chunk in router.generate(request):
                got.extend(chunk.token_ids)
                if len(got) >= 3 and a.proc.poll() is None:
                    a.kill()

        with pytest.raises(EngineUnavailableError, match="mid-generation"):
            await consume_and_kill_a()
        assert got  # tokens came, then the error
        assert not ba.healthy
        # Everything now goes to b, and it works.
        r = await collect(router, req(sampling=SamplingParams(max_new_tokens=5)))
        assert r.finish_reason in {FinishReason.LENGTH, FinishReason.STOP}

        # Health checks re-admit a server once it answers again (here: restarted on its port).
        port = int(a.url.rsplit(":", 1)[1])
        with run_fake_sglang(tiny_model, port=port):
            for _ in range(200):
                if ba.healthy:
                    break
                await asyncio.sleep(0.1)
            assert ba.healthy
            r = await collect(router, req(sampling=SamplingParams(max_new_tokens=5)))
            assert r.token_ids
    finally:
        await router.close()


def test_gateway_answers_503_when_its_server_dies_mid_generation(
    tiny_model: Path, tmp_path: Path
) -> None:
    with (
        run_fake_sglang(tiny_model) as a,
        run_fake_sglang(tiny_model) as b,
        run_gateway(
            tiny_model,
            tmp_path,
            extra_args=["--engine", "sglang", "--engine-url", a.url, "--engine-url", b.url],
        ) as gw,
    ):
        s = gw.new_session()
        headers = {"Authorization": f"Bearer {s['api_key']}"}
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1500,
            "ignore_eos": True,
        }

        async def scenario() -> httpx.Response:
            async with httpx.AsyncClient(timeout=120) as http:
                call = asyncio.create_task(
                    http.post(f"{s['base_url']}/chat/completions", json=body, headers=headers)
                )
                # The first request goes to the first server; kill it once it is generating.
                while not (await http.get(f"{a.url}/v1/loads")).json()["loads"][0][
                    "num_running_reqs"
                ]:
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.2)
                a.kill()
                return await call

        r = asyncio.run(scenario())
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert "mid-generation" in error["message"]
        assert error["type"]
        # The router ejected it; the next request is served by the other server.
        ok = httpx.post(
            f"{s['base_url']}/chat/completions",
            json=body | {"max_tokens": 4},
            headers=headers,
            timeout=60,
        )
        assert ok.status_code == 200, ok.text


async def until(condition: Callable[[], bool], seconds: float = 60) -> None:
    for _ in range(int(seconds / 0.05)):
        if condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("timed out")


async def test_a_server_that_missed_an_update_is_resynced_before_it_serves_again(
    two: tuple[FakeServer, FakeServer], tiny_model: Path, tmp_path: Path
) -> None:
    a, b = two
    router = await router_over(a, b, eject_after=1, readmit_after=2, resync_backoff_max=0.3)
    router.start()
    _, bb = router.backends
    v1 = tmp_path / "v1"
    shutil.copytree(tiny_model, v1)
    try:
        b.kill()
        await until(lambda: not bb.healthy)
        assert await router.update_weights(WeightUpdate(path=v1)) == 1  # b is down: it misses it
        assert bb.state().state == "down"

        # b comes back on its own weights (version 0). Its weights directory is gone for now: the
        # re-sync fails, and b stays out of rotation, "stale", however well it answers.
        hidden = tmp_path / "hidden"
        v1.rename(hidden)
        port = int(b.url.rsplit(":", 1)[1])
        with run_fake_sglang(tiny_model, port=port):
            await until(lambda: "re-sync to version 1 failed" in bb.detail)
            state = bb.state()
            assert (state.state, state.version) == ("stale", 0)
            assert "re-sync to version 1 failed" in state.detail
            for _ in range(6):  # every request goes to a meanwhile
                assert router.pick(req(sampling=SamplingParams(max_new_tokens=2))) is not bb

            # The weights are back: the next retry loads them, good probes re-admit b at 1.
            hidden.rename(v1)
            await until(lambda: bb.healthy)
            assert bb.engine.version() == 1
            assert bb.state() == ServerState(b.url, 1, "up")
            async with httpx.AsyncClient() as http:
                info = (await http.get(f"{b.url}/model_info")).json()
            assert info["weight_version"] == "1"
            # b takes traffic again: with a busy, the next request goes to b, sampled at 1
            ba = router.backends[0]
            busy = asyncio.create_task(collect(router, req()))
            await until(lambda: ba.outstanding == 1)
            r = await collect(router, req(sampling=SamplingParams(max_new_tokens=3)))
            assert r.versions == (1, 1, 1)
            assert (await busy).versions[-1] == 1
    finally:
        await router.close()


def test_the_gateways_metrics_show_a_missed_update_healed(tiny_model: Path, tmp_path: Path) -> None:
    from tests.support.admin_client import parse_prometheus

    v1 = tmp_path / "v1"
    shutil.copytree(tiny_model, v1)
    with (
        run_fake_sglang(tiny_model) as a,
        run_fake_sglang(tiny_model) as b,
        run_gateway(
            tiny_model,
            tmp_path,
            extra_args=["--engine", "sglang", "--engine-url", a.url, "--engine-url", b.url],
        ) as gw,
    ):

        def servers() -> dict[str, tuple[float, str]]:
            samples = parse_prometheus(gw.client.get("/metrics").text)
            out = {}
            for s in (a, b):
                version = samples[f'rlgateway_engine_server_version{{server="{s.url}"}}']
                [state] = [
                    st
                    for st in ("up", "down", "stale")
                    if samples[f'rlgateway_engine_server_state{{server="{s.url}",state="{st}"}}']
                ]
                out[s.url] = (version, state)
            return out

        assert servers() == {a.url: (0, "up"), b.url: (0, "up")}
        b.kill()
        r = gw.client.post("/admin/weights", json={"path": str(v1), "version": 1})
        assert r.status_code == 200, r.text
        port = int(b.url.rsplit(":", 1)[1])
        with run_fake_sglang(tiny_model, port=port):
            deadline = time.monotonic() + 90
            while servers()[b.url] != (1, "up"):
                assert time.monotonic() < deadline, servers()
                time.sleep(0.2)
            assert servers() == {a.url: (1, "up"), b.url: (1, "up")}
            assert httpx.get(f"{b.url}/model_info").json()["weight_version"] == "1"
