"""What the local engine tests share: prompts of mixed lengths, requests, and the parity check
against a teacher-forced forward pass."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from engines.base import (
    GenerateRequest,
    GenerateResult,
    SamplingParams,
    collect,
)
from engines.local import LocalEngine

PROMPTS = [
    list(b"<|im_start|>user\nhello<|im_end|>\n"),
    list(b"The quick brown fox"),
    list(b"1+1="),
    list(b"a much longer prompt, so that the batch mixes different lengths and positions"),
]


def teacher_forced(model: Any, res: GenerateResult, temperature: float) -> list[float]:
    """log_softmax(logits / T) of each sampled token from one full-sequence forward pass."""
    ids = torch.tensor([list(res.prompt_ids) + list(res.token_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0].double()
    t = temperature if temperature > 0 else 1.0
    logp = torch.log_softmax(logits / t, dim=-1)
    start = len(res.prompt_ids) - 1
    return [logp[start + i, tok].item() for i, tok in enumerate(res.token_ids)]


def req(prompt: list[int], **sampling: Any) -> GenerateRequest:
    return GenerateRequest(prompt_ids=tuple(prompt), sampling=SamplingParams(**sampling))


def max_diff(a: list[float], b: tuple[float, ...]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


async def check_parity(engine: LocalEngine, reference: Any, sampling: dict[str, Any]) -> None:
    """Each prompt alone and all batched: logprobs equal a teacher-forced pass (prefill, decode
    and batched decode), and batching changes no token."""
    sp = {**sampling, "max_new_tokens": 40, "ignore_eos": True}
    alone = [await collect(engine, req(p, **sp)) for p in PROMPTS]
    batched = await asyncio.gather(*(collect(engine, req(p, **sp)) for p in PROMPTS))
    for a, b in zip(alone, batched, strict=True):
        ref = teacher_forced(reference, a, sampling["temperature"])
        assert max_diff(ref, a.logprobs) <= 1e-4
        assert len(a.token_ids) == 40
        assert a.versions == (0,) * 40
        if sampling["temperature"] == 0 or "seed" in sampling:
            # batched results equal unbatched ones
            assert b.token_ids == a.token_ids
            assert max_diff(list(b.logprobs), a.logprobs) <= 1e-4


def perturbed(model: Any, scale: float) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(99)
    return {
        k: v + scale * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()
    }


def corrupt_dirs(reference: Any, root: Path) -> dict[str, tuple[Path, str]]:
    """Model directories that must be refused, each with the reason the refusal names."""
    out: dict[str, tuple[Path, str]] = {}
    good = root / "good"
    reference.save_pretrained(good)
    weights = (good / "model.safetensors").read_bytes()
    for name, data in {
        "garbage": b"not a safetensors file at all",
        "truncated": weights[: len(weights) // 2],
    }.items():
        d = root / name
        d.mkdir()
        (d / "config.json").write_bytes((good / "config.json").read_bytes())
        (d / "model.safetensors").write_bytes(data)
        out[name] = (d, "could not read")
    empty = root / "no-weights"
    empty.mkdir()
    (empty / "config.json").write_bytes((good / "config.json").read_bytes())
    out["missing"] = (empty, r"no \*\.safetensors")
    nan = AutoModelForCausalLM.from_config(reference.config).eval()
    nan.load_state_dict(nan_state(reference))
    nan.save_pretrained(root / "nan")
    out["nan"] = (root / "nan", "non-finite")
    return out


def nan_state(reference: Any) -> dict[str, torch.Tensor]:
    state = {k: v.clone() for k, v in reference.state_dict().items()}
    name = "model.layers.0.mlp.down_proj.weight"
    state[name][0, 0] = float("nan")
    return state


async def unchecked(engine: Any, request: GenerateRequest) -> GenerateResult:
    """`collect` without the engine's own check: what a caller that skips it (or a bound the
    check misses) sends into the worker."""
    chunks = [c async for c in engine._stream(request)]
    return GenerateResult(
        request.request_id,
        request.prompt_ids,
        tuple(t for c in chunks for t in c.token_ids),
        tuple(lp for c in chunks for lp in c.logprobs),
        tuple(v for c in chunks for v in c.versions),
        chunks[-1].finish_reason,
    )
