"""What every protocol's tests check of a recording: the session's segments are token-exact, and
their behaviour logprobs are the model's (teacher forcing on the recorded tokens)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest


@functools.cache
def tokenizer_of(model_dir: Path) -> Any:
    from engines.tiny_model import load_tokenizer

    return load_tokenizer(model_dir)


@functools.cache
def hf_model(model_dir: Path) -> Any:
    """The model as the trainer loads it: transformers, float32, no KV cache tricks."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def teacher_forced(model_dir: Path, tokens: list[int], temperature: float = 1.0) -> list[float]:
    """log_softmax(logits / T) of each token given the ones before it (position 0: nan)."""
    import torch

    with torch.no_grad():
        logits_TV = hf_model(model_dir)(torch.tensor([tokens])).logits[0].float()
    logp_TV = torch.log_softmax(logits_TV / temperature, dim=-1)
    picked = logp_TV[:-1].gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
    return [float("nan"), *picked.tolist()]


def only_segment(detail: dict[str, Any]) -> dict[str, Any]:
    assert len(detail["segments"]) == 1, [s["completion_ids"] for s in detail["segments"]]
    seg: dict[str, Any] = detail["segments"][0]
    return seg


def check_segment(seg: dict[str, Any]) -> None:
    """The four arrays share one length; loss_mask is 1 exactly inside the turn spans, where
    versions are 0 (the engine's first policy); outside, logprobs are 0 and versions -1."""
    n = len(seg["tokens"])
    assert len(seg["loss_mask"]) == len(seg["logprobs"]) == len(seg["versions"]) == n
    assert len(seg["turn_spans"]) == len(seg["completion_ids"])
    inside = [False] * n
    prev_end = 0
    for start, end in seg["turn_spans"]:
        assert prev_end <= start < end <= n
        prev_end = end
        for i in range(start, end):
            inside[i] = True
    assert seg["loss_mask"] == [int(x) for x in inside]
    assert seg["versions"] == [0 if x else -1 for x in inside]
    assert all(lp == 0.0 for lp, x in zip(seg["logprobs"], inside, strict=True) if not x)
    assert all(lp <= 0.0 for lp, x in zip(seg["logprobs"], inside, strict=True) if x)


def check_teacher_forced(model_dir: Path, seg: dict[str, Any], temperature: float) -> None:
    """The recorded behaviour logprobs are the model's, token for token, on the recorded tokens."""
    expected = teacher_forced(model_dir, seg["tokens"], temperature)
    for start, end in seg["turn_spans"]:
        assert start >= 1
        for i in range(start, end):
            assert seg["logprobs"][i] == pytest.approx(expected[i], abs=1e-4), (i, start, end)
