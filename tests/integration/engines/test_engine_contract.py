"""The engine contract: what the gateway and the trainer rely on from every engine, checked the
same way on each kind (`tests/support/engine_contract.py`: the local engine, the engine in its
own process, a router over two engines, and the vLLM and SGLang adapters against their fake
servers), on the tiny model.

Generation: tokens and logprobs are the model's (a teacher-forced pass), a seed reproduces,
`max_new_tokens` and stop ids end a request with their finish reason, top logprobs are the k most
likely. Control: abort ends one request and no other, closing a stream early aborts it, pause
holds every token until resume. Weights: an update from a directory versions the tokens sampled
after it, in flight too, and they are the new model's; a refused update changes nothing. Errors:
bad requests raise typed errors before the first chunk, and the engine serves on. Close: live
requests end, new ones are refused. What only one kind does (batching statistics, process
restarts, re-sync, the servers' HTTP surface) stays in that kind's own tests.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from engines.base import (
    Engine,
    FinishReason,
    GenerateRequest,
    SamplingParams,
    TokenChunk,
    WeightUpdate,
    collect,
)
from engines.errors import (
    EngineUnavailableError,
    InvalidRequestError,
    InvalidSamplingError,
    PromptTooLongError,
    TokenOutOfRangeError,
    WeightUpdateError,
)
from tests.support.engine_contract import KINDS, Subject, Teacher
from tests.support.perturb import perturbed_dir

pytestmark = pytest.mark.slow

PROMPT = (1, 5, 9, 20, 30)
ATOL = 1e-4
LONG = 1000
"""Tokens of a request that is still running when the test acts on it (seconds on the fakes)."""


@pytest.fixture(scope="module", params=KINDS)
def subject(request: pytest.FixtureRequest, tiny_model: Path) -> Iterator[Subject]:
    with contextlib.ExitStack() as stack:
        subject = Subject(request.param, tiny_model, stack)
        yield subject
        asyncio.run(subject.close())


@pytest.fixture
async def engine(subject: Subject) -> AsyncIterator[Engine]:
    engine = await subject.open()
    yield engine
    await subject.release(engine)


@pytest.fixture(scope="module")
def teacher() -> Teacher:
    return Teacher()


@pytest.fixture(scope="module")
def trained_dir(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with every weight perturbed: a "new policy" to load."""
    return perturbed_dir(tiny_model, tmp_path_factory.mktemp("trained") / "model", seed=1)


def request(max_new_tokens: int = LONG, **sampling: object) -> GenerateRequest:
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True, **sampling)  # type: ignore[arg-type]
    return GenerateRequest(prompt_ids=PROMPT, sampling=params)


async def until_tokens(chunks: list[TokenChunk], n: int) -> None:
    async with asyncio.timeout(60):  # a request the engine stopped answering fails, not hangs
        while sum(len(c.token_ids) for c in chunks) < n:
            await asyncio.sleep(0.005)


async def consume(engine: Engine, req: GenerateRequest, into: list[TokenChunk]) -> None:
    async for chunk in engine.generate(req):
        into.append(chunk)


# -- generation ---------------------------------------------------------------------------------


async def test_tokens_and_logprobs_are_the_models(
    engine: Engine, subject: Subject, teacher: Teacher
) -> None:
    version = engine.version()
    greedy = await collect(engine, request(12, temperature=0))
    assert greedy.finish_reason is FinishReason.LENGTH
    assert len(greedy.token_ids) == len(greedy.logprobs) == 12
    logp = teacher.logprobs(subject.model_dir, PROMPT + greedy.token_ids, 1.0)
    assert list(greedy.token_ids) == logp[len(PROMPT) - 1 : -1].argmax(-1).tolist()
    want = teacher.picked(subject.model_dir, PROMPT, greedy.token_ids, 1.0)
    assert list(greedy.logprobs) == pytest.approx(want, abs=ATOL)

    first, again = await asyncio.gather(
        *(collect(engine, request(24, temperature=0.7, seed=4, top_logprobs=3)) for _ in "ab")
    )
    assert again.token_ids == first.token_ids  # the seed reproduces, batched or not
    other = await collect(engine, request(24, temperature=0.7, seed=5))
    assert other.token_ids != first.token_ids
    want = teacher.picked(subject.model_dir, PROMPT, first.token_ids, 0.7)
    assert list(first.logprobs) == pytest.approx(want, abs=ATOL)  # post-temperature
    rows = teacher.logprobs(subject.model_dir, PROMPT + first.token_ids, 0.7)
    assert len(first.top_logprobs) == 24
    for top, row in zip(first.top_logprobs, rows[len(PROMPT) - 1 : -1], strict=True):
        values, ids = row.topk(3)
        assert [t for t, _ in top][:3] == ids.tolist()
        assert [v for _, v in top][:3] == pytest.approx(values.tolist(), abs=ATOL)
    assert set(greedy.versions) | set(first.versions) == {version}


async def test_max_tokens_and_stop_ids_end_a_request_with_their_reason(engine: Engine) -> None:
    greedy = await collect(engine, request(16, temperature=0))
    at = next(i for i, t in enumerate(greedy.token_ids) if i > 0 and t not in greedy.token_ids[:i])
    stop = request(16, temperature=0, stop_token_ids=(greedy.token_ids[at],))
    stopped = await collect(engine, stop)
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.token_ids == greedy.token_ids[: at + 1]  # the stop token is the last one
    assert (await collect(engine, request(3))).finish_reason is FinishReason.LENGTH


# -- control ------------------------------------------------------------------------------------


async def test_abort_ends_one_request_and_the_others_run_on(engine: Engine) -> None:
    long, other = request(seed=1), request(40, seed=2)
    chunks: list[TokenChunk] = []
    task = asyncio.create_task(consume(engine, long, chunks))
    others = asyncio.create_task(collect(engine, other))
    await until_tokens(chunks, 3)
    await engine.abort(long.request_id)
    await task
    assert chunks[-1].finish_reason is FinishReason.ABORT
    assert 3 <= sum(len(c.token_ids) for c in chunks) < LONG
    done = await others
    assert (done.finish_reason, len(done.token_ids)) == (FinishReason.LENGTH, 40)
    await engine.abort("no-such-request")  # nothing to abort is no error


async def test_closing_a_stream_early_aborts_its_request(engine: Engine) -> None:
    stream = engine.generate(request(seed=3))
    await anext(stream)
    await stream.aclose()  # type: ignore[attr-defined]
    for _ in range(400):
        health = await engine.health()
        if health.running == health.waiting == 0:
            break
        await asyncio.sleep(0.025)
    assert (health.running, health.waiting) == (0, 0)
    assert len((await collect(engine, request(5))).token_ids) == 5


async def test_pause_holds_every_token_until_resume(engine: Engine) -> None:
    chunks: list[TokenChunk] = []
    task = asyncio.create_task(consume(engine, request(200, seed=5), chunks))
    await until_tokens(chunks, 2)
    await engine.pause()
    try:
        assert (await engine.health()).paused
        await asyncio.sleep(0.3)  # a server's events already on the wire may still arrive
        held = sum(len(c.token_ids) for c in chunks)
        await asyncio.sleep(0.4)
        assert sum(len(c.token_ids) for c in chunks) == held, "tokens came while paused"
        assert not task.done()
    finally:
        await engine.resume()
    await task
    assert not (await engine.health()).paused
    assert chunks[-1].finish_reason is FinishReason.LENGTH
    assert sum(len(c.token_ids) for c in chunks) == 200


async def test_a_request_id_already_live_is_refused_and_the_live_request_runs_on(
    engine: Engine,
) -> None:
    live = request(seed=8)
    chunks: list[TokenChunk] = []
    task = asyncio.create_task(consume(engine, live, chunks))
    await until_tokens(chunks, 1)
    twin = GenerateRequest(prompt_ids=PROMPT, request_id=live.request_id)
    with pytest.raises(InvalidRequestError, match="already live"):
        await collect(engine, twin)
    await until_tokens(chunks, sum(len(c.token_ids) for c in chunks) + 3)  # it runs on
    await engine.abort(live.request_id)  # and the id still reaches it
    await task
    assert chunks[-1].finish_reason is FinishReason.ABORT


# -- weights ------------------------------------------------------------------------------------


async def test_a_weight_update_versions_the_tokens_after_it_in_flight_too(
    engine: Engine, subject: Subject, teacher: Teacher, trained_dir: Path
) -> None:
    v = engine.version()
    chunks: list[TokenChunk] = []
    task = asyncio.create_task(consume(engine, request(seed=6), chunks))
    await until_tokens(chunks, 3)
    try:
        assert await engine.update_weights(WeightUpdate(path=trained_dir)) == v + 1
        assert engine.version() == v + 1
        await task
        versions = [x for c in chunks for x in c.versions]
        swap = versions.index(v + 1)
        assert versions == [v] * swap + [v + 1] * (LONG - swap)
        assert chunks[-1].finish_reason is FinishReason.LENGTH
        after = await collect(engine, request(12, temperature=0))
        assert after.versions == (v + 1,) * 12
        new = teacher.picked(trained_dir, PROMPT, after.token_ids, 1.0)
        old = teacher.picked(subject.model_dir, PROMPT, after.token_ids, 1.0)
        assert list(after.logprobs) == pytest.approx(new, abs=ATOL)
        assert max(abs(a - b) for a, b in zip(new, old, strict=True)) > 1e-2  # they differ
    finally:  # the module's next test finds the model it started with
        await engine.update_weights(WeightUpdate(path=subject.model_dir, version=v + 2))


async def test_a_refused_weight_update_changes_nothing(engine: Engine, tmp_path: Path) -> None:
    v = engine.version()
    before = await collect(engine, request(12, temperature=0))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(WeightUpdateError):
        await engine.update_weights(WeightUpdate(path=tmp_path / "missing"))
    with pytest.raises(WeightUpdateError, match="not newer"):
        await engine.update_weights(WeightUpdate(path=tmp_path, version=v))
    assert engine.version() == v
    after = await collect(engine, request(12, temperature=0))
    assert (after.token_ids, after.versions) == (before.token_ids, (v,) * 12)


# -- errors and close ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bad", "error", "message"),
    [
        (GenerateRequest(prompt_ids=(1, 2), sampling=SamplingParams(temperature=-1)),
         InvalidSamplingError, "temperature"),
        (GenerateRequest(prompt_ids=(1, 10**6)), TokenOutOfRangeError, "outside the vocabulary"),
        (GenerateRequest(prompt_ids=(1,) * 5000), PromptTooLongError, "context is"),
    ],
)  # fmt: skip
async def test_a_bad_request_raises_before_the_first_chunk_and_the_engine_serves_on(
    engine: Engine, bad: GenerateRequest, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        engine.generate(bad)
    assert len((await collect(engine, request(5))).token_ids) == 5


async def test_close_ends_live_requests_and_refuses_new_ones(subject: Subject) -> None:
    engine = await subject.own()
    chunks: list[TokenChunk] = []
    task = asyncio.create_task(consume(engine, request(seed=7), chunks))
    await until_tokens(chunks, 2)
    await engine.close()
    await asyncio.wait_for(task, 60)
    assert chunks[-1].finish_reason is FinishReason.ABORT
    assert not (await engine.health()).ok
    with pytest.raises(EngineUnavailableError):
        await collect(engine, request(5))
    await engine.close()  # a second close is no error
