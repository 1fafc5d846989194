"""The SGLang adapter against `tests/support/fake_sglang.py` (SGLang's documented HTTP shapes,
real generation with the tiny model through transformers), and against real SGLang on a GPU:
what only this adapter does (resubmission across weight updates, in-process state dicts, the
weight group, constrained decoding). Generation, abort, pause and the rest of the engine contract
are checked on every engine in `test_engine_contract.py`.

Logprobs are checked against a teacher-forced transformers pass on the same tokens, so the
adapter's parsing of streamed, cumulative `output_token_logprobs` is checked token for token.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engines.base import (
    Broadcast,
    FinishReason,
    GenerateRequest,
    SamplingParams,
    WeightGroup,
    WeightUpdate,
    collect,
)
from engines.errors import WeightUpdateError
from engines.sglang import SGLangEngine, SGLangEngineConfig
from tests.support.fake_sglang import FakeServer, run_fake_sglang
from tests.support.gateway_server import free_port as _free_port
from tests.support.perturb import perturbed_dir

pytestmark = pytest.mark.slow

PROMPT = (1, 5, 9, 20, 30)
ATOL = 1e-4
BUDGET = 1200
"""Tokens of the requests a weight update interrupts: seconds of generation on the fake."""


@pytest.fixture(scope="module")
def fake(tiny_model: Path) -> Iterator[FakeServer]:
    with run_fake_sglang(tiny_model) as server:
        yield server


@pytest.fixture(scope="module")
def trained_dir(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with every weight perturbed: a "new policy" to load."""
    return perturbed_dir(tiny_model, tmp_path_factory.mktemp("trained") / "model", seed=1)


def teacher_forced(model_dir: Path, tokens: list[int], temperature: float) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    picked = logp[:-1].gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
    return [0.0, *picked.tolist()]


async def connect(url: str) -> SGLangEngine:
    return await SGLangEngine.connect(SGLangEngineConfig(url=url))


async def test_weight_update_from_disk_resubmits_in_flight_requests(
    tiny_model: Path, trained_dir: Path
) -> None:
    with run_fake_sglang(tiny_model) as server:  # its own server: the weights change
        engine = await connect(server.url)
        try:
            sampling = SamplingParams(max_new_tokens=BUDGET, ignore_eos=True)
            reqs = [GenerateRequest(prompt_ids=PROMPT, sampling=sampling) for _ in range(2)]

            async def swap() -> int:
                while engine.live_requests < 2:
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.1)
                return await engine.update_weights(WeightUpdate(path=trained_dir))

            *results, version = await asyncio.gather(*(collect(engine, q) for q in reqs), swap())
            assert version == 1
            with pytest.raises(WeightUpdateError, match="not newer"):
                await engine.update_weights(WeightUpdate(path=trained_dir, version=1))
        finally:
            await engine.close()
        again = await connect(server.url)
        assert again.version() == 1  # the server's weight_version label
        await again.close()
    for r in results:
        assert r.finish_reason == FinishReason.LENGTH
        assert len(r.token_ids) == BUDGET
        swap_at = r.versions.index(1)
        assert swap_at > 0
        assert r.versions == (0,) * swap_at + (1,) * (BUDGET - swap_at)
        tokens = list(PROMPT + r.token_ids)
        old = teacher_forced(tiny_model, tokens, 1.0)[len(PROMPT) :]
        new = teacher_forced(trained_dir, tokens, 1.0)[len(PROMPT) :]
        assert list(r.logprobs[:swap_at]) == pytest.approx(old[:swap_at], abs=ATOL)
        assert list(r.logprobs[swap_at:]) == pytest.approx(new[swap_at:], abs=ATOL)


async def test_an_in_process_state_dict_is_served(
    tiny_model: Path, trained_dir: Path, tmp_path: Path
) -> None:
    """`serve --train --engine sglang`: the trainer hands over a state dict, which the adapter
    writes as a model directory (weights beside the server's config files) and loads from disk."""
    from safetensors.torch import load_file

    from engines.weights import save_model_dir

    state = load_file(str(trained_dir / "model.safetensors"))
    with run_fake_sglang(tiny_model) as server:
        engine = await connect(server.url)
        try:
            assert await engine.update_weights(WeightUpdate(state_dict=state)) == 1
            sampling = SamplingParams(max_new_tokens=8, ignore_eos=True)
            r = await collect(engine, GenerateRequest(prompt_ids=PROMPT, sampling=sampling))
        finally:
            await engine.close()
    assert r.versions == (1,) * 8
    tokens = list(PROMPT + r.token_ids)
    new = teacher_forced(trained_dir, tokens, 1.0)[len(PROMPT) :]
    assert list(r.logprobs) == pytest.approx(new, abs=ATOL)
    # what SGLang reads: the weights and the server's own config, not the shards' index
    (tmp_path / "served").mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors.index.json"):
        (tmp_path / "served" / name).write_text("{}")
    save_model_dir(state, tmp_path / "out", tmp_path / "served")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]


async def test_weights_over_a_process_group(tiny_model: Path, trained_dir: Path) -> None:
    """`/init_weights_update_group`, then `/update_weights_from_distributed` per bucket while the
    trainer's side (`trainer.collective.GroupSender`, rank 0) broadcasts; the fake server uses
    gloo where SGLang uses NCCL, with SGLang's store layout."""
    from safetensors.torch import load_file

    from trainer.collective import GroupSender
    from trainer.weights import buckets_of, tensor_meta

    state = load_file(str(trained_dir / "model.safetensors"))
    names = sorted(state)
    group = WeightGroup("127.0.0.1", _free_port(), 2, backend="gloo", timeout_s=60)
    with run_fake_sglang(tiny_model) as server:
        engine = await connect(server.url)
        try:
            assert await engine.weight_group_ranks() == 1
            sender, _ = await asyncio.gather(
                asyncio.to_thread(GroupSender, group), engine.join_weight_group(group)
            )
            buckets = buckets_of([tensor_meta(n, state[n]) for n in names], 64 << 10)
            assert len(buckets) > 1
            update = WeightUpdate(broadcast=Broadcast(buckets), version=3)
            version, _ = await asyncio.gather(
                engine.update_weights(update),
                asyncio.to_thread(sender.send, [state[n] for n in names]),
            )
            assert version == 3
            sampling = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
            r = await collect(engine, GenerateRequest(prompt_ids=PROMPT, sampling=sampling))
        finally:
            await engine.close()
    assert set(r.versions) == {3}
    tokens = list(PROMPT + r.token_ids)
    new = teacher_forced(trained_dir, tokens, 1.0)[len(PROMPT) :]
    assert list(r.logprobs) == pytest.approx(new, abs=ATOL)


# -- real SGLang (GPU machines) ---------------------------------------------------------------


def _sglang_python() -> str | None:
    """An interpreter with SGLang: `$RLGATEWAY_SGLANG_PYTHON` (its own venv, as `rlgateway serve
    --sglang-python` takes it), else this one if it has the package."""
    import importlib.util
    import sys

    if os.environ.get("RLGATEWAY_SGLANG_PYTHON"):
        return os.environ["RLGATEWAY_SGLANG_PYTHON"]
    return sys.executable if importlib.util.find_spec("sglang") is not None else None


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and _sglang_python()),
    reason="needs CUDA and SGLang ($RLGATEWAY_SGLANG_PYTHON or the sglang package)",
)
def test_real_sglang_generates_and_swaps_weights(
    tiny_model: Path, trained_dir: Path, tmp_path: Path
) -> None:
    from engines.sglang_launch import SGLangLaunchConfig, SGLangServer

    python = _sglang_python()
    assert python is not None
    # the server the gateway's --engine-launch starts, from SGLang's own interpreter
    cfg = SGLangLaunchConfig(
        model=str(tiny_model), python=python, dtype="float32", log_file=str(tmp_path / "sglang.log")
    )

    async def scenario() -> Any:
        server = SGLangServer(cfg, max_restarts=0)
        await server.start(startup_s=600)
        engine = await connect(server.url)
        engine.server = server  # closing the engine stops the server
        try:
            sampling = SamplingParams(max_new_tokens=400, ignore_eos=True)
            req = GenerateRequest(prompt_ids=PROMPT, sampling=sampling)
            task = asyncio.create_task(collect(engine, req))
            await asyncio.sleep(0.2)
            assert await engine.update_weights(WeightUpdate(path=trained_dir)) == 1
            return await task
        finally:
            await engine.close()

    r = asyncio.run(scenario())
    assert len(r.token_ids) == 400
    assert r.versions[-1] == 1
    tokens = list(PROMPT + r.token_ids)
    new = teacher_forced(trained_dir, tokens, 1.0)[len(PROMPT) :]
    at = r.versions.index(1)
    assert list(r.logprobs[at:]) == pytest.approx(new[at:], abs=1e-2)  # GPU kernels differ


async def test_a_json_schema_reaches_the_server_and_holds_the_reply(
    fake: FakeServer, tiny_model: Path
) -> None:
    """Structured outputs pass through as SGLang's `json_schema` sampling parameter; the server
    masks its logits by the schema before its logprobs, so they are the masked distribution's:
    never below the model's own, and the reply is the schema's JSON."""
    import json

    from engines.tiny_model import load_tokenizer

    schema = {
        "type": "object",
        "properties": {"kind": {"enum": ["cat", "dog"]}, "n": {"type": "integer", "maximum": 9}},
        "required": ["kind", "n"],
        "additionalProperties": False,
    }
    engine = await connect(fake.url)
    try:
        sampling = SamplingParams(
            temperature=1.0, seed=2, max_new_tokens=40, json_schema=json.dumps(schema)
        )
        r = await collect(engine, GenerateRequest(prompt_ids=PROMPT, sampling=sampling))
    finally:
        await engine.close()
    assert r.finish_reason == FinishReason.STOP
    reply = json.loads(load_tokenizer(tiny_model).decode(list(r.token_ids[:-1])))
    assert reply["kind"] in ("cat", "dog")
    assert 0 <= reply["n"] <= 9
    free = teacher_forced(tiny_model, list(PROMPT + r.token_ids), 1.0)[len(PROMPT) :]
    assert all(a >= b - ATOL for a, b in zip(r.logprobs, free, strict=True))
    assert any(a > b + 0.1 for a, b in zip(r.logprobs, free, strict=True))


async def test_a_forced_tool_calls_grammar_reaches_the_server_as_ebnf(
    fake: FakeServer, tiny_model: Path
) -> None:
    """A forced tool call's grammar (llguidance's Lark) passes through as SGLang's `ebnf`, which
    `--grammar-backend llguidance` (the launcher's) reads as Lark: the reply is the call."""
    import json

    from engines.tiny_model import load_tokenizer
    from gateway.core.tool_parsers import HermesParser

    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 9}}}
    tools = [{"type": "function", "function": {"name": "count", "parameters": schema}}]
    tok = load_tokenizer(tiny_model)
    marks = {t.content: i for i, t in tok.added_tokens_decoder.items()}
    parser = HermesParser()
    grammar = parser.grammar(tools, "count", False, marks)
    prompt = tuple(tok.encode("count" + parser.prefill("count")))
    engine = await connect(fake.url)
    try:
        sampling = SamplingParams(temperature=1.0, seed=3, max_new_tokens=60, grammar=grammar)
        r = await collect(engine, GenerateRequest(prompt_ids=prompt, sampling=sampling))
    finally:
        await engine.close()
    assert r.finish_reason == FinishReason.STOP
    _, [call] = parser.parse(parser.prefill("count") + tok.decode(list(r.token_ids[:-1])))
    assert call.name == "count"
    assert json.loads(call.arguments).keys() <= {"n"}
