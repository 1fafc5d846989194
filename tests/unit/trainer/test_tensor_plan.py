"""Which Hugging Face models the tensor-parallel plan takes (`trainer.parallel.tensor`): the check
the FSDP backend runs on a model's config before it loads any weights."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from trainer.parallel.strategy import ParallelStrategy
from trainer.parallel.tensor import LAYER_PLANS, check_model_fits

T2 = ParallelStrategy(tensor=2)


def qwen2(kv_heads: int = 2, *, tied: bool = False) -> Qwen2Config:
    return Qwen2Config(
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        tie_word_embeddings=tied,
    )


@pytest.mark.parametrize(
    "config",
    [
        qwen2(),
        Qwen3Config(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
        LlamaConfig(num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False),
    ],
)
def test_llama_qwen2_and_qwen3_decoders_split(config: object) -> None:
    check_model_fits(T2, config)
    check_model_fits(ParallelStrategy(data=4, tensor=2), config)


def test_the_plans_cover_the_architectures_they_name() -> None:
    assert sorted(LAYER_PLANS) == ["llama", "qwen2", "qwen3"]
    # Qwen3 adds its per-head q/k norms, split over the heads (dim 2) like the projections
    assert LAYER_PLANS["qwen3"]().keys() - LAYER_PLANS["qwen2"]().keys() == {
        "self_attn.q_norm",
        "self_attn.k_norm",
    }


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (qwen2(kv_heads=1), "1 key-value heads do not divide by 2"),
        (
            MistralConfig(num_attention_heads=4, num_key_value_heads=2),
            "has plans for llama, qwen2, qwen3 models; this one is 'mistral'",
        ),
        (qwen2(tied=True), "needs untied input and output embeddings"),
    ],
)
def test_what_tensor_parallel_cannot_split_is_refused(config: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_model_fits(T2, config)
    check_model_fits(ParallelStrategy(data=2), config)  # data parallel takes any of them
