"""The local engine in its own process (`ProcessEngine`): the same tokens and logprobs as in
this process, batching, weight swaps through shared memory and from a directory, refused swaps
across the process boundary, faults contained to the request they concern, and an engine process
that is started again when it dies, on the current weights and version. What every engine does
alike (abort, pause, close, bad requests) is checked in `test_engine_contract.py`."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from engines.base import Engine, FinishReason, GenerateResult, WeightUpdate, collect
from engines.errors import (
    EngineUnavailableError,
    InvalidSamplingError,
    RequestFailedError,
    WeightUpdateError,
)
from engines.ipc import _shm_dir
from engines.local import LocalEngine, LocalEngineConfig
from engines.process import ProcessEngine, RestartPolicy
from tests.support.local_engine import (
    PROMPTS,
    corrupt_dirs,
    max_diff,
    nan_state,
    perturbed,
    req,
    teacher_forced,
    unchecked,
)
from tests.support.procs import live_children

# Starting an engine process costs seconds (a fresh interpreter imports torch and transformers),
# so the tests share one and leave it as they found it (running, on the reference weights); only
# the tests that kill or close an engine start their own.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def shared(tiny_model: Path) -> Iterator[ProcessEngine]:
    engine = ProcessEngine.load(LocalEngineConfig(model=str(tiny_model)))
    yield engine
    asyncio.run(engine.close())


@pytest.fixture
def engine(shared: ProcessEngine) -> ProcessEngine:
    return shared


@pytest.fixture
async def own_engine(tiny_model: Path) -> AsyncIterator[ProcessEngine]:
    """An engine process of its own that is not started again when it dies."""
    engine = ProcessEngine.load(
        LocalEngineConfig(model=str(tiny_model)), restart=RestartPolicy(max_restarts=0)
    )
    yield engine
    await engine.close()


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _staged_files() -> list[Path]:
    return list(_shm_dir().glob(f"rlgateway-weights-{os.getpid()}-*"))


async def test_same_tokens_and_logprobs_as_the_engine_in_this_process(
    shared: ProcessEngine, tiny_model: Path
) -> None:
    assert isinstance(shared, Engine)
    assert shared.pid != os.getpid()
    assert _alive(shared.pid)
    local = LocalEngine.load(LocalEngineConfig(model=str(tiny_model)))
    try:
        requests = [
            req(PROMPTS[i % 4], seed=i, temperature=0.8, top_p=0.9, max_new_tokens=24,
                top_logprobs=3 if i == 1 else 0)
            for i in range(6)
        ] + [req(PROMPTS[0], temperature=0, max_new_tokens=24)]  # fmt: skip
        theirs = await asyncio.gather(*(collect(shared, r) for r in requests))
        ours = await asyncio.gather(*(collect(local, r) for r in requests))
    finally:
        await local.close()
    for a, b in zip(theirs, ours, strict=True):
        assert a.token_ids == b.token_ids
        assert max_diff(list(a.logprobs), b.logprobs) <= 1e-5
        assert a.versions == b.versions == (0,) * len(b.token_ids)
        assert a.finish_reason is b.finish_reason
        assert len(a.top_logprobs) == len(b.top_logprobs)
    assert len(theirs[1].top_logprobs[0]) == 3


async def test_concurrent_requests_share_decode_steps(engine: ProcessEngine) -> None:
    await engine.pause()
    n, length = 12, 32  # 12 of PROMPTS: 399 tokens, within one step's prefill budget
    tasks = [
        asyncio.create_task(
            collect(engine, req(PROMPTS[i % 4], seed=i, max_new_tokens=length, ignore_eos=True))
        )
        for i in range(n)
    ]
    while (await engine.health()).waiting < n:
        await asyncio.sleep(0.01)
    steps = engine.stats.decode_steps
    await engine.resume()
    results = await asyncio.gather(*tasks)
    assert all(len(r.token_ids) == length for r in results)
    assert engine.stats.max_decode_batch == n
    # every decode step served all 12 sequences
    assert engine.stats.decode_steps - steps == length - 1


async def test_a_state_dict_swap_through_shared_memory_versions_later_tokens(
    engine: ProcessEngine, reference: Any
) -> None:
    new_state = perturbed(reference, 0.05)
    v = engine.version()
    request = req(PROMPTS[0], seed=8, max_new_tokens=120, ignore_eos=True)
    ids: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    async for chunk in engine.generate(request):
        ids += chunk.token_ids
        logprobs += chunk.logprobs
        versions += chunk.versions
        if len(ids) == 20:
            assert await engine.update_weights(WeightUpdate(state_dict=new_state)) == v + 1
            assert engine.version() == v + 1
    swap = versions.index(v + 1)
    assert 20 <= swap < 120
    assert versions == [v] * swap + [v + 1] * (120 - swap)
    res = GenerateResult(
        "x", request.prompt_ids, tuple(ids), tuple(logprobs), tuple(versions), FinishReason.LENGTH
    )
    new_model = AutoModelForCausalLM.from_config(reference.config).eval()
    new_model.load_state_dict(new_state)
    assert max_diff(teacher_forced(reference, res, 1.0)[:swap], tuple(logprobs[:swap])) <= 1e-4
    assert max_diff(teacher_forced(new_model, res, 1.0)[swap:], tuple(logprobs[swap:])) <= 1e-4
    # the staging file is unlinked once the engine process mapped it: nothing left behind
    assert _staged_files() == []
    # a second swap reuses the mapping: back to the reference weights, greedy output as before
    assert await engine.update_weights(WeightUpdate(state_dict=reference.state_dict())) == v + 2
    res2 = await collect(engine, req(PROMPTS[2], temperature=0, max_new_tokens=20))
    assert max_diff(teacher_forced(reference, res2, 0.0), res2.logprobs) <= 1e-4
    assert res2.versions == (v + 2,) * 20


async def test_a_directory_swap_and_refused_swaps_cross_the_boundary(
    engine: ProcessEngine, reference: Any, tmp_path: Path
) -> None:
    greedy = req(PROMPTS[2], temperature=0, max_new_tokens=20)
    before = await collect(engine, greedy)
    bad_shape = dict(reference.state_dict())
    bad_shape["lm_head.weight"] = torch.zeros(3, 3)
    with pytest.raises(WeightUpdateError, match=r"lm_head\.weight has shape"):
        await engine.update_weights(WeightUpdate(state_dict=bad_shape))
    with pytest.raises(WeightUpdateError, match=r"no \*\.safetensors"):
        await engine.update_weights(WeightUpdate(path=tmp_path))
    assert (await collect(engine, greedy)).token_ids == before.token_ids  # nothing changed
    new_model = AutoModelForCausalLM.from_config(reference.config).eval()
    new_model.load_state_dict(perturbed(reference, 0.05))
    new_model.save_pretrained(tmp_path)
    v = engine.version() + 5
    assert await engine.update_weights(WeightUpdate(path=tmp_path, version=v)) == v
    with pytest.raises(WeightUpdateError, match="not newer"):
        await engine.update_weights(WeightUpdate(path=tmp_path, version=v))
    res = await collect(engine, greedy)
    assert res.versions == (v,) * 20
    assert max_diff(teacher_forced(new_model, res, 0.0), res.logprobs) <= 1e-4
    await engine.update_weights(WeightUpdate(state_dict=reference.state_dict()))


async def test_a_dead_engine_process_fails_streams_and_calls_clearly(
    own_engine: ProcessEngine,
) -> None:
    engine = own_engine
    task = asyncio.create_task(
        collect(engine, req(PROMPTS[1], max_new_tokens=1000, ignore_eos=True))
    )
    while engine.stats.decode_steps < 2:
        await asyncio.sleep(0.005)
    os.kill(engine.pid, signal.SIGKILL)
    with pytest.raises(EngineUnavailableError, match="exited with code -9"):
        await task
    health = await engine.health()
    assert not health.ok
    assert "exited with code -9" in health.detail
    assert "not started again" in health.detail  # its policy allows no restart
    with pytest.raises(EngineUnavailableError, match="exited with code -9"):
        await collect(engine, req(PROMPTS[1], max_new_tokens=5))
    with pytest.raises(EngineUnavailableError):
        await engine.pause()
    with pytest.raises(EngineUnavailableError):
        await engine.update_weights(WeightUpdate(path=Path("/nonexistent")))


async def test_close_aborts_live_requests_and_stops_the_process(tiny_model: Path) -> None:
    engine = ProcessEngine.load(LocalEngineConfig(model=str(tiny_model)))
    task = asyncio.create_task(
        collect(engine, req(PROMPTS[1], max_new_tokens=1000, ignore_eos=True))
    )
    while engine.stats.decode_steps < 2:
        await asyncio.sleep(0.005)
    await engine.close()
    assert (await task).finish_reason is FinishReason.ABORT
    assert not _alive(engine.pid)
    assert not (await engine.health()).ok
    with pytest.raises(EngineUnavailableError, match="closed"):
        await collect(engine, req(PROMPTS[1], max_new_tokens=5))
    await engine.close()  # idempotent


def test_a_bad_model_directory_fails_to_load_with_its_reason(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"could not load the model.*Unrecognized model"):
        ProcessEngine.load(LocalEngineConfig(model=str(tmp_path)))


# -- faults stay with the request they concern -------------------------------------------------


async def test_bad_sampling_fails_one_request_and_the_engine_process_serves_on(
    engine: ProcessEngine,
) -> None:
    """The two requests that ended inference for everyone on main: a top_k of 2**63 (now the
    whole vocabulary: no truncation) and min_tokens with an out-of-vocabulary stop id (refused
    by the check; sent past it, it fails in the engine process for that request alone)."""
    good = req(PROMPTS[1], seed=3, max_new_tokens=60, ignore_eos=True)
    alone = await collect(engine, good)
    huge_k = req(PROMPTS[1], seed=3, max_new_tokens=60, ignore_eos=True, top_k=2**63)
    assert (await collect(engine, huge_k)).token_ids == alone.token_ids
    bad = req(PROMPTS[0], min_new_tokens=3, max_new_tokens=10, stop_token_ids=(10**6,))
    with pytest.raises(InvalidSamplingError, match=r"stop_token_ids must be token ids in \[0, "):
        engine.generate(bad)
    beside = asyncio.create_task(collect(engine, good))
    while not (await engine.health()).running:
        await asyncio.sleep(0.001)
    with pytest.raises(RequestFailedError, match="failed while serving this request") as failed:
        await unchecked(engine, bad)
    assert failed.value.retry_after is not None
    assert (await beside).token_ids == alone.token_ids
    assert (await collect(engine, good)).token_ids == alone.token_ids
    assert (await engine.health()).ok


async def test_unloadable_weights_are_refused_across_the_boundary(
    engine: ProcessEngine, reference: Any, tmp_path: Path
) -> None:
    greedy = req(PROMPTS[2], temperature=0, max_new_tokens=20)
    before = await collect(engine, greedy)
    v = engine.version()
    with pytest.raises(WeightUpdateError, match="non-finite"):
        await engine.update_weights(WeightUpdate(state_dict=nan_state(reference)))
    for path, reason in corrupt_dirs(reference, tmp_path).values():
        with pytest.raises(WeightUpdateError, match=reason):
            await engine.update_weights(WeightUpdate(path=path))
    with pytest.raises(WeightUpdateError, match="larger than the largest policy version"):
        await engine.update_weights(WeightUpdate(path=tmp_path / "good", version=2**31))
    after = await collect(engine, greedy)
    assert after.token_ids == before.token_ids
    assert after.logprobs == before.logprobs
    assert engine.version() == v
    assert _staged_files() == []


# -- supervision: a dead engine process is started again ---------------------------------------


async def _until_up(engine: ProcessEngine) -> None:
    async with asyncio.timeout(120):
        while not (await engine.health()).ok:
            await asyncio.sleep(0.1)


async def test_a_killed_engine_process_comes_back_on_the_current_weights(
    tiny_model: Path, reference: Any
) -> None:
    engine = ProcessEngine.load(LocalEngineConfig(model=str(tiny_model)))
    try:
        greedy = req(PROMPTS[2], temperature=0, max_new_tokens=20)
        assert await engine.update_weights(WeightUpdate(state_dict=perturbed(reference, 0.05))) == 1
        # a refused update in between: the restart must not pick it up
        with pytest.raises(WeightUpdateError):
            await engine.update_weights(WeightUpdate(state_dict=nan_state(reference)))
        before = await collect(engine, greedy)
        first_pid = engine.pid
        task = asyncio.create_task(
            collect(engine, req(PROMPTS[1], max_new_tokens=1000, ignore_eos=True))
        )
        while engine.stats.decode_steps < 2:
            await asyncio.sleep(0.005)
        os.kill(first_pid, signal.SIGKILL)
        with pytest.raises(EngineUnavailableError, match="exited with code -9") as lost:
            await task
        assert lost.value.retry_after is not None
        assert lost.value.retry_after >= 1
        down = await engine.health()
        assert not down.ok
        assert "restarting" in down.detail
        with pytest.raises(EngineUnavailableError, match="restarting") as refused:
            await collect(engine, greedy)
        assert refused.value.retry_after is not None
        await _until_up(engine)
        assert engine.pid != first_pid
        assert not _alive(first_pid)
        health = await engine.health()
        assert health.restarts == engine.restarts == 1
        assert health.version == engine.version() == 1
        after = await collect(engine, greedy)
        assert after.token_ids == before.token_ids
        assert max_diff(list(after.logprobs), before.logprobs) <= 1e-6
        assert after.versions == (1,) * 20
        assert _staged_files() == []  # the copy handed to the new process is unlinked too
        assert await engine.update_weights(WeightUpdate(state_dict=reference.state_dict())) == 2
    finally:
        await engine.close()
    assert not _alive(engine.pid)


async def test_an_engine_process_that_keeps_dying_stays_down_and_closes(tiny_model: Path) -> None:
    engine = ProcessEngine.load(
        LocalEngineConfig(model=str(tiny_model)),
        restart=RestartPolicy(max_restarts=1, backoff_s=0.1),
    )
    try:
        os.kill(engine.pid, signal.SIGKILL)
        await _until_up(engine)
        assert engine.restarts == 1
        os.kill(engine.pid, signal.SIGKILL)
        while "not started again" not in (health := await engine.health()).detail:
            await asyncio.sleep(0.05)
        assert not health.ok
        assert "died 2 times" in health.detail
        with pytest.raises(EngineUnavailableError, match="not started again") as refused:
            await collect(engine, req(PROMPTS[1], max_new_tokens=5))
        assert refused.value.retry_after is None
    finally:
        await engine.close()


async def test_close_during_a_restart_stops_it(tiny_model: Path) -> None:
    others = _children()
    engine = ProcessEngine.load(LocalEngineConfig(model=str(tiny_model)))
    os.kill(engine.pid, signal.SIGKILL)
    while "restarting" not in (await engine.health()).detail:
        await asyncio.sleep(0.01)
    await engine.close()
    assert not (await engine.health()).ok
    assert not _alive(engine.pid)
    assert _children() == others  # neither the killed engine process nor a new one is left


def _children() -> list[tuple[int, bytes]]:
    """(pid, command line) of this process's live children."""
    return live_children(os.getpid())
