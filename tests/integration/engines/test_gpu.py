"""On a CUDA device (skipped without one): the local engine and the FSDP backend agree on the
logprobs of sampled tokens in float32, bf16 generation and bf16 mixed-precision training work, and
a weight swap on the GPU makes the engine serve the trainer's new weights."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from engines.base import GenerateRequest, SamplingParams, WeightUpdate, collect
from engines.local import LocalEngine, LocalEngineConfig
from trainer.backends.config import FSDPBackendConfig
from trainer.backends.registry import build_backend
from trainer.batch import TrainSequence
from trainer.sft import SFTExample, sft_step

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPTS = [list(b"<|im_start|>user\nLargest of 7 2 9 4?<|im_end|>\n"), list(b"The quick brown")]


async def sample(engine: LocalEngine, n: int, max_tokens: int = 24) -> list[TrainSequence]:
    reqs = [
        GenerateRequest(
            prompt_ids=tuple(PROMPTS[i % len(PROMPTS)]),
            sampling=SamplingParams(temperature=1.0, max_new_tokens=max_tokens, seed=i),
        )
        for i in range(n)
    ]
    results = await asyncio.gather(*(collect(engine, r) for r in reqs))
    seqs = []
    for res in results:
        p, t = list(res.prompt_ids), list(res.token_ids)
        seqs.append(
            TrainSequence(
                tokens=p + t,
                loss_mask=[0] * len(p) + [1] * len(t),
                behav_logprobs=[0.0] * len(p) + list(res.logprobs),
                advantages=[0.0] * (len(p) + len(t)),
                versions=[-1] * len(p) + list(res.versions),
            )
        )
    return seqs


def worst_gap(seqs: list[TrainSequence], logps: list[list[float]]) -> float:
    return max(
        abs(b - t)
        for s, lp in zip(seqs, logps, strict=True)
        for m, b, t in zip(s.loss_mask, s.behav_logprobs, lp, strict=True)
        if m
    )


async def test_cuda_engine_and_trainer_agree_and_a_swap_serves_new_weights(
    tiny_model: Path,
) -> None:
    engine = LocalEngine.load(
        LocalEngineConfig(model=str(tiny_model), device="cuda", dtype="float32")
    )
    try:
        backend = build_backend(
            FSDPBackendConfig(model_dir=str(tiny_model), lr=3e-3, total_steps=8)
        )
        seqs = await sample(engine, 16)
        gap = worst_gap(seqs, backend.forward_logprobs(seqs, 1.0))
        print(f"engine vs trainer on CUDA, float32: worst |dlogp| {gap:.2e}")
        assert gap <= 1e-4

        examples = [SFTExample(s.tokens[:10], s.tokens[10:]) for s in seqs]
        for _ in range(3):
            sft_step(backend, examples)
        version = await engine.update_weights(
            WeightUpdate(state_dict=backend.full_state_dict(), version=3)
        )
        assert version == 3
        seqs = await sample(engine, 16)
        assert all(v == 3 for s in seqs for v, m in zip(s.versions, s.loss_mask, strict=True) if m)
        gap = worst_gap(seqs, backend.forward_logprobs(seqs, 1.0))
        print(f"after a swap on CUDA: worst |dlogp| {gap:.2e}")
        assert gap <= 1e-4
    finally:
        await engine.close()


async def test_bf16_generation_and_mixed_precision_training(tiny_model: Path) -> None:
    engine = LocalEngine.load(LocalEngineConfig(model=str(tiny_model), device="cuda"))  # bf16
    try:
        seqs = await sample(engine, 8)
    finally:
        await engine.close()
    backend = build_backend(
        FSDPBackendConfig(model_dir=str(tiny_model), lr=3e-3, total_steps=8, mixed_precision="bf16")
    )
    gap = worst_gap(seqs, backend.forward_logprobs(seqs, 1.0))
    print(f"bf16 engine vs bf16 trainer: worst |dlogp| {gap:.2e}")
    assert gap < 0.1
    examples = [SFTExample(s.tokens[:10], s.tokens[10:]) for s in seqs]
    first = sft_step(backend, examples)["loss"]
    for _ in range(5):
        last = sft_step(backend, examples)["loss"]
    assert last < first
