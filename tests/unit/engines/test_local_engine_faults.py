"""The embedded local engine's faults: each stays with the request it concerns (a request that
fails in the worker fails alone, a step's fault fails its sequences and the engine goes on), and
weight updates are checked whole before anything is swapped (the old weights keep serving)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from engines.base import (
    TokenChunk,
    WeightUpdate,
    collect,
)
from engines.errors import (
    EngineUnavailableError,
    InvalidSamplingError,
    RequestFailedError,
    WeightUpdateError,
)
from engines.limits import MAX_POLICY_VERSION
from engines.local import LocalEngine, LocalEngineConfig
from engines.local_worker import MAX_FAILED_STEPS
from tests.support.local_engine import (
    PROMPTS,
    corrupt_dirs,
    max_diff,
    nan_state,
    perturbed,
    req,
    unchecked,
)

# -- faults stay with the request they concern -------------------------------------------------


async def test_a_top_k_beyond_the_vocabulary_truncates_nothing(shared_engine: LocalEngine) -> None:
    sampling = {"seed": 5, "max_new_tokens": 20, "ignore_eos": True}
    plain = await collect(shared_engine, req(PROMPTS[1], **sampling))
    for top_k in (2**63, 2**80, shared_engine.runner.vocab_size):
        huge = await collect(shared_engine, req(PROMPTS[1], top_k=top_k, **sampling))
        assert huge.token_ids == plain.token_ids
        assert max_diff(list(huge.logprobs), plain.logprobs) <= 1e-6
    # top logprobs past the vocabulary size are clamped too (the tiny vocabulary is > 20)
    assert shared_engine.runner.vocab_size > 20


async def test_stop_ids_outside_the_vocabulary_are_refused_naming_the_field(
    shared_engine: LocalEngine,
) -> None:
    vocab = shared_engine.runner.vocab_size
    bad = req(PROMPTS[0], min_new_tokens=2, max_new_tokens=5, stop_token_ids=(3, vocab))
    with pytest.raises(InvalidSamplingError, match=rf"stop_token_ids .*\[0, {vocab}\).*{vocab}"):
        shared_engine.generate(bad)
    with pytest.raises(InvalidSamplingError, match=r"temperature must be 0 .* or at least"):
        shared_engine.generate(req(PROMPTS[0], temperature=1e-300))


async def test_a_request_that_fails_in_the_worker_fails_alone(
    engine: LocalEngine, caplog: pytest.LogCaptureFixture
) -> None:
    """The crash of main: min_tokens with an out-of-vocabulary stop id indexed out of range in the
    sampler and ended the worker. Sent past the check, it fails that request only, while a
    request decoding beside it (or sampled in one batch with it) finishes with the tokens it has
    alone, and the engine serves on; so does a checked request with nothing left to sample."""
    good = req(PROMPTS[1], seed=3, max_new_tokens=40, ignore_eos=True)
    alone = await collect(engine, good)
    vocab = engine.runner.vocab_size
    for bad_sampling in (
        {"min_new_tokens": 3, "stop_token_ids": (10**6,)},
        {"min_new_tokens": 3, "stop_token_ids": (vocab + 1,), "temperature": 0},
    ):
        beside = asyncio.create_task(collect(engine, good))
        while engine.stats.decode_steps < 3 or not (await engine.health()).running:
            await asyncio.sleep(0.001)
        bad = req(PROMPTS[0], max_new_tokens=10, **bad_sampling)
        with pytest.raises(RequestFailedError, match="failed while serving this request"):
            await unchecked(engine, bad)
        assert (await beside).token_ids == alone.token_ids
        assert (await engine.health()).ok
    # the same in one batch: both are prefilled and sampled together, then each alone
    await engine.pause()
    together = asyncio.create_task(collect(engine, good))
    failing = asyncio.create_task(unchecked(engine, bad))
    while (await engine.health()).waiting < 2:
        await asyncio.sleep(0.001)
    await engine.resume()
    with pytest.raises(RequestFailedError):
        await failing
    assert (await together).token_ids == alone.token_ids
    assert "sampling 2 sequences failed" in caplog.text
    # a request the check lets through with nothing to sample: min_tokens masks every token
    everything = req(PROMPTS[0], min_new_tokens=2, stop_token_ids=tuple(range(vocab)))
    beside = asyncio.create_task(collect(engine, good))
    with pytest.raises(RequestFailedError, match="every token is excluded"):
        await collect(engine, everything)
    assert (await beside).token_ids == alone.token_ids
    later = await collect(engine, good)
    assert later.token_ids == alone.token_ids


async def test_a_fault_of_a_step_fails_its_sequences_and_the_engine_goes_on(
    engine: LocalEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    decode = engine.runner.decode
    faults = {"left": 1}

    def faulty(token_ids: list[int], positions: list[int]) -> torch.Tensor:
        if faults["left"] and engine.stats.decode_steps >= 2:
            faults["left"] -= 1
            raise RuntimeError("injected decode fault")
        return decode(token_ids, positions)

    monkeypatch.setattr(engine.runner, "decode", faulty)
    long = {"max_new_tokens": 30, "ignore_eos": True}
    results = await asyncio.gather(
        *(collect(engine, req(PROMPTS[i], seed=i, **long)) for i in range(3)),
        return_exceptions=True,
    )
    assert all(isinstance(r, RequestFailedError) for r in results), results
    assert "injected decode fault" in str(results[0])
    assert (await engine.health()).ok
    assert len((await collect(engine, req(PROMPTS[2], **long))).token_ids) == 30

    # a fault in every step: the engine gives up after MAX_FAILED_STEPS and says so
    faults["left"] = 10**6
    for _ in range(MAX_FAILED_STEPS):
        with pytest.raises(EngineUnavailableError):
            await collect(engine, req(PROMPTS[2], **long))
    health = await engine.health()
    assert not health.ok
    assert "steps in a row failed" in health.detail
    with pytest.raises(EngineUnavailableError, match="failed"):
        await collect(engine, req(PROMPTS[2], **long))


# -- weight updates are checked whole before anything is swapped ------------------------------


async def test_unloadable_weights_are_refused_and_the_old_ones_keep_serving(
    engine: LocalEngine, reference: Any, tmp_path: Path
) -> None:
    greedy = req(PROMPTS[2], temperature=0, max_new_tokens=20)
    before = await collect(engine, greedy)
    bad_states: dict[str, tuple[dict[str, torch.Tensor], str]] = {
        "nan": (nan_state(reference), r"model\.layers\.0\.mlp\.down_proj\.weight has non-finite"),
        "inf": (
            {k: v.clone().fill_(float("inf")) for k, v in reference.state_dict().items()},
            "non-finite",
        ),
        "int dtype": (
            {k: torch.zeros(v.shape, dtype=torch.int64) for k, v in reference.state_dict().items()},
            "does not cast",
        ),
        "shape": ({**reference.state_dict(), "lm_head.weight": torch.zeros(3, 3)}, "has shape"),
        "unknown name": ({**reference.state_dict(), "extra.weight": torch.zeros(1)}, "unexpected"),
    }
    for what, (state, reason) in bad_states.items():
        with pytest.raises(WeightUpdateError, match=reason):
            await engine.update_weights(WeightUpdate(state_dict=state))
        assert engine.version() == 0, what
    for what, (path, reason) in corrupt_dirs(reference, tmp_path).items():
        with pytest.raises(WeightUpdateError, match=reason):
            await engine.update_weights(WeightUpdate(path=path))
        assert engine.version() == 0, what
    too_new = MAX_POLICY_VERSION + 1
    with pytest.raises(WeightUpdateError, match=f"version {too_new} is larger"):
        await engine.update_weights(
            WeightUpdate(state_dict=reference.state_dict(), version=too_new)
        )
    after = await collect(engine, greedy)
    assert after.token_ids == before.token_ids
    assert after.logprobs == before.logprobs
    assert after.versions == (0,) * 20
    assert (await engine.health()).ok
    assert await engine.update_weights(WeightUpdate(state_dict=reference.state_dict())) == 1


async def test_a_swap_that_fails_half_way_stops_the_engine_rather_than_serve_mixed_weights(
    engine: LocalEngine, reference: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    task = asyncio.create_task(
        collect(engine, req(PROMPTS[1], max_new_tokens=1000, ignore_eos=True))
    )
    while engine.stats.decode_steps < 2:
        await asyncio.sleep(0.005)

    def failing_copy(state: Mapping[str, torch.Tensor]) -> None:
        name, tensor = next(iter(state.items()))
        with torch.no_grad():
            engine.model.state_dict()[name].copy_(tensor)  # the first tensor is in
        raise RuntimeError("injected fault while copying the weights")

    monkeypatch.setattr(engine.worker, "_copy_in", failing_copy)
    with pytest.raises(EngineUnavailableError, match="swapping in the weights"):
        await engine.update_weights(WeightUpdate(state_dict=perturbed(reference, 0.05)))
    with pytest.raises(EngineUnavailableError):
        await task
    health = await engine.health()
    assert not health.ok
    assert "half-way" in health.detail
    assert engine.version() == 0


async def test_a_step_fault_after_a_swap_fails_only_the_sequences_that_step_ran(
    tiny_model: Path, reference: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A swap puts the live sequence back at the head of the queue and, within a budget of one
    prompt, the request admitted beside it goes back to waiting. The step's decode then fails:
    the live sequence (which that step ran) fails; the waiting request was not part of the step,
    so it is served afterwards, whole, on the new weights."""
    engine = LocalEngine.load(LocalEngineConfig(model=str(tiny_model), max_prefill_tokens=10))
    items: dict[str, list[Any]] = {"a": [], "b": []}
    finished = threading.Event()
    late = req(PROMPTS[3], seed=2, max_new_tokens=3, ignore_eos=True)
    update = WeightUpdate(state_dict=perturbed(reference, 0.05))
    real_decode = engine.runner.decode
    decodes = [0]
    sent: list[bool] = []

    def decode(*args: Any) -> Any:
        decodes[0] += 1
        if decodes[0] == 2:  # the step that swapped and re-queued
            raise RuntimeError("injected fault in a decode step")
        return real_decode(*args)

    class Both:
        def deliver(self, got: list[tuple[str, Any]]) -> None:
            for request_id, item in got:
                items["a" if request_id == first.request_id else "b"].append(item)
            if not sent:  # after the first step: a new request and a swap arrive
                sent.append(True)
                engine.worker.submit(late, self)
                engine.worker.submit_update(update)
            if items["b"] and (
                isinstance(items["b"][-1], BaseException) or items["b"][-1].finish_reason
            ):
                finished.set()

    monkeypatch.setattr(engine.runner, "decode", decode)
    first = req(PROMPTS[3], seed=1, max_new_tokens=50, ignore_eos=True)
    try:
        engine.worker.submit(first, Both())
        assert await asyncio.to_thread(finished.wait, 60)
        assert isinstance(items["a"][-1], RequestFailedError)
        assert all(isinstance(c, TokenChunk) for c in items["b"]), items["b"]
        assert [v for c in items["b"] for v in c.versions] == [1, 1, 1]
        assert (await engine.health()).ok
    finally:
        await engine.close()
