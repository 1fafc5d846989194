"""Tiny models the parallel tests build beside the tiny test model: a Qwen3 whose shapes split
over tensor-parallel ranks."""

from __future__ import annotations

from pathlib import Path

import torch


def build_tiny_qwen3(out: Path) -> Path:
    """A tiny Qwen3 (per-head q/k norms, random norm weights) with the tiny vocabulary, seeded."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=263,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
        pad_token_id=256,
        bos_token_id=None,
        eos_token_id=258,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(out)
    return out
