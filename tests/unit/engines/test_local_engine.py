"""The embedded local engine: parity with a teacher-forced forward alone and batched (dense and
MoE), batching statistics, sampling controls, held-back chunks, state-dict swaps in flight, and
typed errors for every bad input. What every engine does alike (abort, pause, close, directory
swaps) is checked on each in `tests/integration/engines/test_engine_contract.py`."""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from engines.base import (
    Engine,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
    TokenChunk,
    WeightUpdate,
    collect,
)
from engines.errors import (
    EmptyPromptError,
    InvalidSamplingError,
    PromptTooLongError,
    TokenOutOfRangeError,
    WeightUpdateError,
)
from engines.local import LocalEngine, LocalEngineConfig
from tests.support.local_engine import (
    PROMPTS,
    check_parity,
    max_diff,
    perturbed,
    req,
    teacher_forced,
)


def test_local_engine_satisfies_the_protocol(shared_engine: LocalEngine) -> None:
    assert isinstance(shared_engine, Engine)


PARITY_SAMPLING = pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0.0},
        {"temperature": 1.0, "seed": 3},
        {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "seed": 4},
    ],
    ids=["greedy", "sampled", "truncated"],
)


@PARITY_SAMPLING
async def test_logprobs_match_a_teacher_forced_pass_alone_and_batched(
    shared_engine: LocalEngine, reference: Any, sampling: dict[str, Any]
) -> None:
    await check_parity(shared_engine, reference, sampling)


@PARITY_SAMPLING
async def test_moe_logprobs_match_a_teacher_forced_pass_alone_and_batched(
    moe_engine: LocalEngine, moe_reference: Any, sampling: dict[str, Any]
) -> None:
    await check_parity(moe_engine, moe_reference, sampling)


async def test_max_tokens_stop_ids_and_min_tokens(shared_engine: LocalEngine) -> None:
    base = await collect(
        shared_engine, req(PROMPTS[0], temperature=0, max_new_tokens=25, ignore_eos=True)
    )
    assert len(base.token_ids) == 25
    assert base.finish_reason is FinishReason.LENGTH
    # a stop id ends generation at its first occurrence, and is the last token
    stop = base.token_ids[5]
    first = base.token_ids.index(stop)
    stopped = await collect(
        shared_engine,
        req(PROMPTS[0], temperature=0, max_new_tokens=25, ignore_eos=True, stop_token_ids=(stop,)),
    )
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.token_ids == base.token_ids[: first + 1]
    # min_new_tokens masks the stop id until enough tokens were generated
    at_once = base.token_ids[0]
    held = await collect(
        shared_engine,
        req(
            PROMPTS[0],
            temperature=0,
            max_new_tokens=25,
            min_new_tokens=4,
            ignore_eos=True,
            stop_token_ids=(at_once,),
        ),
    )
    assert len(held.token_ids) >= 4
    assert at_once not in held.token_ids[:4]
    # the context is a hard limit
    room = shared_engine.max_model_len - len(PROMPTS[3])
    full = await collect(shared_engine, req(PROMPTS[3], temperature=0, ignore_eos=True))
    assert len(full.token_ids) == room
    assert full.finish_reason is FinishReason.LENGTH


async def test_top_logprobs_are_the_k_most_likely_under_the_same_distribution(
    shared_engine: LocalEngine, reference: Any
) -> None:
    res = await collect(
        shared_engine, req(PROMPTS[1], temperature=0.8, seed=2, max_new_tokens=10, top_logprobs=5)
    )
    assert len(res.top_logprobs) == len(res.token_ids) == 10
    ids = torch.tensor([list(res.prompt_ids) + list(res.token_ids)])
    with torch.no_grad():
        logp = torch.log_softmax(reference(ids).logits[0].double() / 0.8, dim=-1)
    start = len(res.prompt_ids) - 1
    for i, top in enumerate(res.top_logprobs):
        ref_vals, ref_ids = logp[start + i].topk(5)
        assert [t for t, _ in top] == ref_ids.tolist()
        assert max(abs(a - b) for (_, a), b in zip(top, ref_vals.tolist(), strict=True)) <= 1e-4
    plain = await collect(shared_engine, req(PROMPTS[1], max_new_tokens=3))
    assert plain.top_logprobs == ()


def test_the_models_eos_ids_stop_generation(shared_engine: LocalEngine, tiny_model: Path) -> None:
    from engines.tiny_model import load_tokenizer

    tok = load_tokenizer(tiny_model)
    # eos ids join stop_token_ids in one stop set (exercised above); ignore_eos drops them
    assert shared_engine.eos_token_ids == {
        tok.convert_tokens_to_ids("<|im_end|>"),
        tok.convert_tokens_to_ids("<|endoftext|>"),
    }


async def test_concurrent_requests_share_decode_steps(engine: LocalEngine) -> None:
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
    await engine.resume()
    results = await asyncio.gather(*tasks)
    assert all(len(r.token_ids) == length for r in results)
    stats = engine.stats
    assert stats.max_decode_batch == n
    # every decode step served all 12 sequences: n * (length - 1) tokens in length - 1 steps
    assert stats.decode_steps == length - 1
    assert stats.decode_tokens == n * (length - 1)


class _Recorder:
    """A worker consumer that keeps each request's chunks and, when the first chunks arrive (on
    the worker thread, between two steps), submits `update`."""

    def __init__(self, worker: Any, update: WeightUpdate, n: int) -> None:
        self.worker, self.update, self.n = worker, update, n
        self.chunks: dict[str, list[TokenChunk]] = defaultdict(list)
        self.finished = threading.Event()
        self.future: Any = None

    def deliver(self, items: list[tuple[str, Any]]) -> None:
        for request_id, item in items:
            assert isinstance(item, TokenChunk), item
            self.chunks[request_id].append(item)
        if self.future is None:
            self.future = self.worker.submit_update(self.update)
        ended = [c for c in self.chunks.values() if c[-1].finish_reason is not None]
        if len(ended) == self.n:
            self.finished.set()


@pytest.mark.parametrize(
    ("budget", "first_part", "prefill_steps", "most", "decode_steps"),
    [(10_000, 8, 2, 8 * 79, 2), (160, 2, 5, 2 * 79, 7), (10, 1, 9, 79, 11)],
)
async def test_a_burst_is_prefilled_over_steps_within_the_prefill_budget(
    tiny_model: Path,
    reference: Any,
    budget: int,
    first_part: int,
    prefill_steps: int,
    most: int,
    decode_steps: int,
) -> None:
    """`max_prefill_tokens` bounds the prompt tokens one step prefills (a longer prompt alone),
    and the live sequences decode between the parts of a burst. A weight update submitted after
    the first step lands before the second: the live sequences (2 tokens each by then) go back
    to the head of the queue and are prefilled again, whole (77 + 2 tokens), within the same
    budget, so every token after the update, theirs and the rest of the burst's, is the new
    version's."""
    engine = LocalEngine.load(LocalEngineConfig(model=str(tiny_model), max_prefill_tokens=budget))
    try:
        worker = engine.worker
        recorder = _Recorder(worker, WeightUpdate(state_dict=perturbed(reference, 0.05)), n=8)
        requests = [req(PROMPTS[3], seed=i, max_new_tokens=4, ignore_eos=True) for i in range(8)]
        assert len(PROMPTS[3]) == 77
        worker.set_paused(True)
        for request in requests:
            worker.submit(request, recorder)
        worker.set_paused(False)
        assert await asyncio.to_thread(recorder.finished.wait, 60)
        assert recorder.future.result(timeout=60) == 1
        stats = engine.stats
        assert (stats.prefill_steps, stats.max_step_prefill_tokens) == (prefill_steps, most)
        assert stats.decode_steps == decode_steps
        versions = [
            [v for c in recorder.chunks[r.request_id] for v in c.versions] for r in requests
        ]
        assert versions == [[0, 0, 1, 1]] * first_part + [[1, 1, 1, 1]] * (8 - first_part)
    finally:
        await engine.close()


async def test_a_stream_interval_batches_chunks_and_changes_no_token(
    shared_engine: LocalEngine,
) -> None:
    """Held-back tokens arrive in chunks of the interval (the first token at once, the rest with
    the finish), and tokens, logprobs, versions and top logprobs are those of interval 1."""
    sampling = SamplingParams(seed=7, max_new_tokens=40, ignore_eos=True, top_logprobs=2)

    async def chunks(interval: int) -> list[Any]:
        request = GenerateRequest(
            prompt_ids=tuple(PROMPTS[0]), sampling=sampling, stream_interval=interval
        )
        return [c async for c in shared_engine.generate(request)]

    each, held = await chunks(1), await chunks(16)
    assert [len(c.token_ids) for c in each] == [1] * 40
    assert [len(c.token_ids) for c in held] == [1, 16, 16, 7]
    assert [c.finish_reason for c in held] == [None, None, None, FinishReason.LENGTH]
    for field in ("token_ids", "logprobs", "versions", "top_logprobs"):
        assert [x for c in held for x in getattr(c, field)] == [
            x for c in each for x in getattr(c, field)
        ]


async def test_an_abort_delivers_the_tokens_held_back(engine: LocalEngine) -> None:
    request = GenerateRequest(
        prompt_ids=tuple(PROMPTS[1]),
        sampling=SamplingParams(seed=1, max_new_tokens=400, ignore_eos=True),
        stream_interval=1000,
    )
    stream = engine.generate(request)
    first = await anext(stream)
    while (await engine.health()).running and engine.stats.decode_steps < 10:
        await asyncio.sleep(0.005)
    await engine.abort(request.request_id)
    rest = [c async for c in stream]
    assert len(first.token_ids) == 1
    assert len(rest) == 1
    assert rest[0].finish_reason is FinishReason.ABORT
    assert len(rest[0].token_ids) >= 9  # every token sampled before the abort, none lost


async def test_weight_update_mid_generation_versions_later_tokens(
    engine: LocalEngine, reference: Any
) -> None:
    new_state = perturbed(reference, 0.05)
    request = req(PROMPTS[0], seed=8, max_new_tokens=120, ignore_eos=True)
    ids: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    async for chunk in engine.generate(request):
        ids += chunk.token_ids
        logprobs += chunk.logprobs
        versions += chunk.versions
        if len(ids) == 20:
            assert await engine.update_weights(WeightUpdate(state_dict=new_state)) == 1
    assert engine.version() == 1
    swap = versions.index(1)
    assert 20 <= swap < 120
    assert versions == [0] * swap + [1] * (120 - swap)
    res = GenerateResult(
        "x", request.prompt_ids, tuple(ids), tuple(logprobs), tuple(versions), FinishReason.LENGTH
    )
    old = teacher_forced(reference, res, 1.0)
    new_model = AutoModelForCausalLM.from_config(reference.config).eval()
    new_model.load_state_dict(new_state)
    new = teacher_forced(new_model, res, 1.0)
    assert max_diff(old[:swap], tuple(logprobs[:swap])) <= 1e-4
    assert max_diff(new[swap:], tuple(logprobs[swap:])) <= 1e-4
    # the two policies really differ on these tokens, so the check above can fail
    assert max_diff(old[swap:], tuple(logprobs[swap:])) > 1e-2


async def test_bad_weight_updates_are_refused_and_change_nothing(
    engine: LocalEngine, reference: Any
) -> None:
    before = await collect(engine, req(PROMPTS[2], temperature=0, max_new_tokens=20))
    bad_shape = dict(reference.state_dict())
    bad_shape["lm_head.weight"] = torch.zeros(3, 3)
    with pytest.raises(WeightUpdateError, match=r"lm_head\.weight has shape"):
        await engine.update_weights(WeightUpdate(state_dict=bad_shape))
    missing = {k: v for k, v in reference.state_dict().items() if k != "lm_head.weight"}
    with pytest.raises(WeightUpdateError, match="missing"):
        await engine.update_weights(WeightUpdate(state_dict=missing))
    assert await engine.update_weights(WeightUpdate(state_dict=reference.state_dict())) == 1
    with pytest.raises(WeightUpdateError, match="not newer"):
        await engine.update_weights(WeightUpdate(state_dict=reference.state_dict(), version=1))
    after = await collect(engine, req(PROMPTS[2], temperature=0, max_new_tokens=20))
    assert after.token_ids == before.token_ids
    assert engine.version() == 1


@pytest.mark.parametrize(
    ("request_", "error", "message"),
    [
        (req([]), EmptyPromptError, "empty"),
        (req([1, 2], temperature=-1), InvalidSamplingError, "temperature"),
        (req([1, 2], top_p=0.0), InvalidSamplingError, "top_p"),
        (req([1, 2], top_k=-1), InvalidSamplingError, "top_k"),
        (
            GenerateRequest(prompt_ids=(1, 2), stream_interval=0),
            InvalidSamplingError,
            "stream_interval",
        ),
        (req([1, 2], max_new_tokens=0), InvalidSamplingError, "max_new_tokens"),
        (req([1, 2], max_new_tokens=2, min_new_tokens=3), InvalidSamplingError, "min_new"),
        (req([1, 10**6]), TokenOutOfRangeError, "outside the vocabulary"),
    ],
)
def test_bad_input_raises_typed_errors(
    shared_engine: LocalEngine, request_: GenerateRequest, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        shared_engine.generate(request_)


def test_prompt_too_long_names_both_lengths(shared_engine: LocalEngine) -> None:
    limit = shared_engine.max_model_len
    with pytest.raises(PromptTooLongError, match=f"{limit + 5} tokens.*context is {limit}"):
        shared_engine.generate(req([1] * (limit + 5)))
    with pytest.raises(PromptTooLongError, match=f"at most {limit - 10} new tokens"):
        shared_engine.generate(req([1] * 10, max_new_tokens=limit))
