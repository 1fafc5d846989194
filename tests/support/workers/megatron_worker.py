"""The Megatron backend's runs under torchrun, on CPU through the test harness
(tests/support/megatron_cpu.py), compared with the FSDP backend's in
tests/integration/trainer/test_megatron.py.

From the repository root, `PYTHONPATH=. python -m torch.distributed.run --nproc-per-node 2
tests/support/workers/megatron_worker.py MODEL OUT ALLOC` writes each rank's result to
OUT/rank{r}.pt: the last stage's logits against the Hugging Face model's (`logit_errors`), then
`tp_worker.run`'s training run (steps, checkpoint, resume, publish, logprobs, weights) without a
critic.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from tests.support import megatron_cpu

megatron_cpu.install()

from tests.support.workers import tp_worker  # noqa: E402
from tests.support.workers.fsdp_worker import TOKEN_BUDGET, build_backend, make_sequences  # noqa: E402
from trainer.batch import MicroBatch, pack  # noqa: E402


def logit_errors(model_dir: str, allocation: str) -> list[float]:
    """On the last stage, per packed micro-batch: the largest difference between this tensor
    rank's logits and the same vocabulary columns of the Hugging Face model's logits, each
    sequence run alone; [] on the other stages."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    backend = build_backend(model_dir, allocation)
    start, end = backend.vocab_columns
    errors: list[float] = []
    seqs = make_sequences()

    def compare(logits_T1V: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        ours = logits_T1V[:, 0, : end - start]
        offset = 0
        for length in mb.seq_lens:
            ids = mb.input_ids_1T[:, offset : offset + length]
            with torch.no_grad():
                theirs = hf(input_ids=ids).logits[0, :, start:end]
            errors.append(float((ours[offset : offset + length] - theirs).abs().max()))
            offset += length
        return logits_T1V.new_zeros(())

    with torch.no_grad():
        backend._run(pack(seqs, TOKEN_BUDGET), compare, forward_only=True)
    del backend
    return errors


def knobs(model_dir: str, out: str) -> None:
    """One step with and without `gradient_checkpointing` (counting decoder-layer forwards), into
    OUT/knobs.pt."""
    seqs = make_sequences()
    result: dict[str, Any] = {}
    for name, settings in {
        "plain": {},
        "recompute": {"gradient_checkpointing": True},
    }.items():
        backend = build_backend(model_dir, "megatron", **settings)
        calls = [0]

        def count(*_: Any, calls: list[int] = calls) -> None:
            calls[0] += 1

        for layer in backend.stage.module.decoder.layers:
            layer.register_forward_hook(count)
        stats = tp_worker.step(backend, seqs)
        result[name] = {"stats": stats, "layer_forwards": calls[0]}
        result[name]["logprobs"] = backend.forward_logprobs(seqs, 0.7, token_budget=TOKEN_BUDGET)
        del backend
    torch.save(result, Path(out) / "knobs.pt")


def main(model_dir: str, out: str, allocation: str) -> None:
    import torch.distributed as dist

    result: dict[str, Any] = {"logit_errors": logit_errors(model_dir, allocation)}
    result |= tp_worker.run(model_dir, allocation, Path(out) / "ckpt", critic=False)
    torch.save(result, Path(out) / f"rank{dist.get_rank()}.pt")


if __name__ == "__main__":
    from tests.support.torchrun import exit_worker

    if sys.argv[1] == "knobs":
        knobs(*sys.argv[2:])
    else:
        main(*sys.argv[1:])
    exit_worker()
