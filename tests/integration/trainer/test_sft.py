"""SFT through the training backend (the demo's warm start): the loss is the mean NLL of the
completion tokens, checked against an independent float64 forward, and steps lower it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainer.backends.config import FSDPBackendConfig
from trainer.backends.registry import build_backend
from trainer.sft import SFTExample, sft_sequences, sft_step


def examples() -> list[SFTExample]:
    return [
        SFTExample(prompt=[72, 105, 58], completion=[111, 107, 33, 258]),
        SFTExample(prompt=[50, 43, 50, 61], completion=[52, 258]),
        SFTExample(prompt=[120], completion=[121, 122]),
    ]


def reference_nll(model_dir: Path, exs: list[SFTExample]) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float64)
    total, count = 0.0, 0
    with torch.no_grad():
        for ex in exs:
            ids = torch.tensor([ex.prompt + ex.completion])
            logp = torch.log_softmax(model(input_ids=ids).logits[0], dim=-1)
            for j in range(len(ex.completion)):
                pos = len(ex.prompt) + j
                total -= float(logp[pos - 1, ids[0, pos]])
                count += 1
    return total / count


def test_sft_sequences_mask_only_the_completion() -> None:
    seqs = sft_sequences(examples())
    assert seqs[0].loss_mask == [0, 0, 0, 1, 1, 1, 1]
    assert seqs[1].tokens == [50, 43, 50, 61, 52, 258]
    assert all(
        s.num_loss_tokens == len(e.completion) for s, e in zip(seqs, examples(), strict=True)
    )


def test_sft_loss_is_the_mean_completion_nll_and_steps_lower_it(tiny_model: Path) -> None:
    backend = build_backend(FSDPBackendConfig(model_dir=str(tiny_model), lr=3e-3, total_steps=30))
    exs = examples()
    first = sft_step(backend, exs, token_budget=8)  # several micro-batches: accumulation counts
    assert first["loss"] == pytest.approx(reference_nll(tiny_model, exs), abs=1e-5)
    for _ in range(20):
        last = sft_step(backend, exs)
    assert last["loss"] < 0.5 * first["loss"]
