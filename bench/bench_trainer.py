"""Trainer throughput and hot-swap cost, side by side in one run.

    .venv/bin/python bench/bench_trainer.py [--model tiny|demo|smollm2|DIR] [--seqs 64]
        [--steps 5] [--token-budget B] [--no-swap]

1. Training tokens/s of the FSDP backend (packed micro-batches, no padding; per-sequence varlen
   attention and, for comparison, SDPA with a block-diagonal mask over the row) against a plain
   single-process torch loop on the same sequences (padded batches of 8, the same policy-gradient
   loss, AdamW), and the padding each way wastes.
   The three run in interleaved rounds (one step each per round, `--steps` rounds after a warmup
   step), and the figures are medians, so that load from other processes falls on all alike.
2. Hot-swap: `engine.update_weights(state_dict)` into the local engine, idle and with 32
   generations in flight (their KV caches are recomputed under the new weights), against the time
   to copy the state dict.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import resource
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def make_sequences(n: int, vocab: int, seed: int) -> list[Any]:
    from trainer.batch import TrainSequence

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = rng.randint(30, 120)
        sampled = rng.choice([16, 32, 64, 128, 256])  # long-tailed, like agent replies
        length = prompt + sampled
        mask = [0] * prompt + [1] * sampled
        out.append(
            TrainSequence(
                tokens=[rng.randrange(vocab) for _ in range(length)],
                loss_mask=mask,
                behav_logprobs=[-2.0 * m for m in mask],
                advantages=[rng.gauss(0, 1) * m for m in mask],
                versions=[0 if m else -1 for m in mask],
            )
        )
    return out


def pg_loss(logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, norm: float) -> torch.Tensor:
    return -(logp * adv * mask).sum() / norm


def backend_stepper(
    model_dir: str, seqs: list[Any], budget: int, attention: str
) -> Callable[[], None]:
    """One FSDP-backend optimizer step over `seqs` per call (packed, `attention` kernel)."""
    from trainer.backends.fsdp import FSDPBackend

    backend = FSDPBackend(model_dir, lr=1e-5, attention=attention)  # type: ignore[arg-type]
    norm = float(sum(s.num_loss_tokens for s in seqs))

    def loss_fn(
        logp_1T: torch.Tensor, mb: Any, n: float, entropy_1T: Any = None
    ) -> tuple[torch.Tensor, dict[str, float]]:
        return pg_loss(logp_1T, mb.advantages_1T, mb.loss_mask_1T.float(), n), {}

    def step() -> None:
        backend.train_step(seqs, loss_fn, temperature=1.0, token_budget=budget, global_norm=norm)

    return step


def plain_stepper(model_dir: str, seqs: list[Any], batch: int) -> tuple[Callable[[], None], float]:
    """A plain loop's optimizer step (padded batches of `batch` sequences in the given order) per
    call, and the fraction of its tokens that are padding."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    norm = float(sum(s.num_loss_tokens for s in seqs))
    groups = [seqs[i : i + batch] for i in range(0, len(seqs), batch)]
    padded = sum(len(g) * max(len(s) for s in g) for g in groups)
    real = sum(len(s) for s in seqs)

    def step() -> None:
        opt.zero_grad()
        for group in groups:
            width = max(len(s) for s in group)
            ids = torch.zeros(len(group), width, dtype=torch.long)
            attn = torch.zeros(len(group), width, dtype=torch.long)
            adv = torch.zeros(len(group), width)
            mask = torch.zeros(len(group), width)
            for b, s in enumerate(group):
                n = len(s)
                ids[b, :n] = torch.tensor(s.tokens)
                attn[b, :n] = 1
                adv[b, :n] = torch.tensor(s.advantages)
                mask[b, :n] = torch.tensor(s.loss_mask, dtype=torch.float)
            logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
            logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
            pg_loss(logp, adv[:, 1:], mask[:, 1:], norm).backward()
        opt.step()

    return step, 1 - real / padded


def interleaved(steppers: dict[str, Callable[[], None]], rounds: int) -> dict[str, list[float]]:
    """Seconds per step of each stepper: one warmup step each, then `rounds` rounds that run every
    stepper once in turn, so that load from other processes falls on all of them alike."""
    for step in steppers.values():
        step()
    times: dict[str, list[float]] = {name: [] for name in steppers}
    for _ in range(rounds):
        for name, step in steppers.items():
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    return times


async def swap_times(model_dir: str, repeats: int) -> dict[str, float]:
    from engines.base import GenerateRequest, SamplingParams, WeightUpdate, collect
    from engines.local import LocalEngine, LocalEngineConfig

    engine = LocalEngine.load(LocalEngineConfig(model=str(model_dir)))
    state = {k: v.clone() for k, v in engine.model.state_dict().items()}
    copies, idle, busy = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        _ = {k: v.clone() for k, v in state.items()}
        copies.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        await engine.update_weights(WeightUpdate(state_dict=state))
        idle.append(time.perf_counter() - t0)
    for _ in range(repeats):
        sp = SamplingParams(max_new_tokens=1500, ignore_eos=True)
        reqs = [GenerateRequest(prompt_ids=tuple(range(1, 40 + i)), sampling=sp) for i in range(32)]
        tasks = [asyncio.create_task(collect(engine, r)) for r in reqs]
        while engine.stats.decode_steps < 1 or (await engine.health()).running < 32:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)  # let the sequences grow a few hundred tokens
        t0 = time.perf_counter()
        await engine.update_weights(WeightUpdate(state_dict=state))
        busy.append(time.perf_counter() - t0)
        for r in reqs:
            await engine.abort(r.request_id)
        await asyncio.gather(*tasks)
    await engine.close()
    return {
        "copy": statistics.median(copies),
        "idle": statistics.median(idle),
        "busy": statistics.median(busy),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model", default="tiny", help="tiny (the test model), demo, smollm2 or a directory"
    )
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--token-budget", type=int, default=1024)
    ap.add_argument("--no-swap", action="store_true", help="skip the hot-swap table")
    args = ap.parse_args()

    from transformers import AutoConfig

    from engines.tiny_model import tiny_model_dir
    from rlgateway.models import resolve_model

    if args.model == "demo":
        model_dir = str(tiny_model_dir(size="demo"))
    else:
        model_dir = str(resolve_model(args.model, Path.cwd()))
    config = AutoConfig.from_pretrained(model_dir)
    vocab = config.vocab_size
    seqs = make_sequences(args.seqs, vocab, seed=0)
    tokens = sum(len(s) for s in seqs)
    plain, waste = plain_stepper(model_dir, seqs, batch=8)
    budget = args.token_budget
    times = interleaved(
        {
            "varlen": backend_stepper(model_dir, seqs, budget, "varlen"),
            "sdpa": backend_stepper(model_dir, seqs, budget, "sdpa"),
            "plain": plain,
        },
        args.steps,
    )
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    med = {name: statistics.median(t) for name, t in times.items()}
    # per round, plain / backend: robust to load that changes from round to round
    ratio = {
        name: statistics.median(p / b for p, b in zip(times["plain"], times[name], strict=True))
        for name in ("varlen", "sdpa")
    }
    print(
        f"\nmodel {args.model} (hidden {config.hidden_size}, {config.num_hidden_layers} layers), "
        f"{args.seqs} sequences, {tokens} tokens per step, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, median of {args.steps} interleaved rounds; the "
        f"process's peak resident memory (three models and their optimizers): {peak_gb:.1f} GB\n"
    )
    print("| trainer | s/step | tokens/s | vs plain | padding waste |")
    print("|---|---:|---:|---:|---:|")
    for name, label in (
        ("varlen", f"FSDP backend, packed (budget {budget}), varlen attention"),
        ("sdpa", f"FSDP backend, packed (budget {budget}), sdpa block-diagonal mask"),
    ):
        print(f"| {label} | {med[name]:.2f} | {tokens / med[name]:.0f} | {ratio[name]:.2f}x | 0% |")
    print(
        f"| plain torch loop, padded batches of 8 | {med['plain']:.2f} | "
        f"{tokens / med['plain']:.0f} | 1.00x | {100 * waste:.0f}% |\n"
    )
    if args.no_swap:
        return
    swap = asyncio.run(swap_times(model_dir, repeats=3))
    print("| hot-swap | ms |")
    print("|---|---:|")
    print(f"| copy the state dict (clone) | {1000 * swap['copy']:.1f} |")
    print(f"| update_weights, idle engine | {1000 * swap['idle']:.1f} |")
    print(
        f"| update_weights, 32 generations in flight (KV recomputed) | {1000 * swap['busy']:.1f} |"
    )


if __name__ == "__main__":
    main()
