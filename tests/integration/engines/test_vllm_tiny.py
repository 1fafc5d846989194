"""vLLM serves the tiny model with the same numbers as transformers.

The gateway trusts an engine's per-token logprobs as behaviour logprobs, so vLLM's must equal a
teacher-forced transformers pass over the same tokens: `log_softmax(logits)` for greedy and
`log_softmax(logits / temperature)` when sampling.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from engines.tiny_model import load_tokenizer
from tests.support.vllm_server import (
    ATOL,
    SERVED_MODEL_NAME,
    complete,
    needs_vllm,
    teacher_forced_logprobs,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, needs_vllm]


@pytest.fixture(scope="module")
def model_dir(tiny_model: Path) -> Path:
    """The model the session's vLLM server (`vllm_url`, tests/integration/conftest.py) serves."""
    return tiny_model


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt_ids(model_dir: Path) -> list[int]:
    messages = [{"role": "user", "content": "Count to ten, please."}]
    ids = load_tokenizer(model_dir).apply_chat_template(messages, add_generation_prompt=True)
    return list(ids["input_ids"])


def test_greedy_logprobs_match_transformers(
    vllm_url: str, hf_model: PreTrainedModel, prompt_ids: list[int]
) -> None:
    token_ids, logprobs = complete(vllm_url, prompt_ids, temperature=0)
    expected = teacher_forced_logprobs(hf_model, prompt_ids, token_ids, temperature=1.0)
    assert token_ids == expected.argmax(dim=-1).tolist()
    picked = expected.gather(-1, torch.tensor(token_ids)[:, None])[:, 0]
    diff = (torch.tensor(logprobs) - picked).abs().max().item()
    assert diff < ATOL, f"max |vLLM - transformers| logprob = {diff:.2e}"


def test_sampled_logprobs_are_post_temperature(
    vllm_url: str, hf_model: PreTrainedModel, prompt_ids: list[int]
) -> None:
    greedy_ids, _ = complete(vllm_url, prompt_ids, temperature=0)
    token_ids, logprobs = complete(vllm_url, prompt_ids, temperature=0.7, seed=1234)
    assert token_ids != greedy_ids  # it sampled
    assert complete(vllm_url, prompt_ids, temperature=0.7, seed=1234)[0] == token_ids
    expected = teacher_forced_logprobs(hf_model, prompt_ids, token_ids, temperature=0.7)
    picked = expected.gather(-1, torch.tensor(token_ids)[:, None])[:, 0]
    diff = (torch.tensor(logprobs) - picked).abs().max().item()
    assert diff < ATOL, f"max |vLLM - transformers| logprob = {diff:.2e}"


def test_vllm_renders_the_chat_template_like_transformers(vllm_url: str, model_dir: Path) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Add two integers.",
                "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
            },
        }
    ]
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "add", "arguments": '{"a": 2}'},
    }
    messages = [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": "2+0? 🎉"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "2"},
        {"role": "assistant", "content": "2."},
        {"role": "user", "content": [{"type": "text", "text": "Thanks"}]},
    ]
    body = {
        "model": SERVED_MODEL_NAME,
        "messages": messages,
        "tools": tools,
        "add_generation_prompt": True,
    }
    response = httpx.post(f"{vllm_url}/tokenize", json=body, timeout=60)
    response.raise_for_status()
    expected = load_tokenizer(model_dir).apply_chat_template(
        messages, tools=tools, add_generation_prompt=True
    )
    assert response.json()["tokens"] == list(expected["input_ids"])
