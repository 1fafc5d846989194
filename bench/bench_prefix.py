"""Prefix-shared (tree) training against flat packing, side by side in one run.

    .venv/bin/python bench/bench_prefix.py [--model tiny smollm2 DIR ...] [--shape grpo multiturn]
        [--groups 1] [--group-size 8] [--prompt 512] [--answer 64] [--rounds 2]
        [--token-budget 2048]

Two FSDP backends on the same model (`backend.prefix_sharing` off and on) take one optimizer step
each per round on the same batch (GRPO's decoupled loss, random tokens: the cost does not depend on
them), after one warmup step each, taking turns to go first; the table gives the median seconds per
step and the batch's tokens (every sequence whole, as flat packing trains them) per second, and the
row positions each packing runs. Shapes: `grpo`, groups of `--group-size` answers of `--answer`
tokens to one `--prompt`-token prompt each; `multiturn`, episodes as the multi-turn example's (a
prompt, then 1 to 3 answers of up to 48 tokens, each wrong one followed by 24 tokens of feedback),
where only the first prompt is common to a group.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path
from typing import Any


def grpo_batch(
    groups: int, size: int, prompt: int, answer: int, vocab: int, rng: random.Random
) -> list[Any]:
    from trainer.batch import TrainSequence

    out = []
    for _ in range(groups):
        head = [rng.randrange(vocab) for _ in range(prompt)]
        for _ in range(size):
            tokens = head + [rng.randrange(vocab) for _ in range(answer)]
            mask = [0] * prompt + [1] * answer
            out.append(_sequence(TrainSequence, tokens, mask, rng))
    return out


def multiturn_batch(
    groups: int, size: int, prompt: int, vocab: int, rng: random.Random
) -> list[Any]:
    from trainer.batch import TrainSequence

    out = []
    for _ in range(groups):
        head = [rng.randrange(vocab) for _ in range(prompt)]
        for _ in range(size):
            tokens, mask = list(head), [0] * prompt
            for turn in range(rng.randint(1, 3)):
                if turn:  # the environment's feedback on the last answer
                    tokens += [rng.randrange(vocab) for _ in range(24)]
                    mask += [0] * 24
                n = rng.randint(8, 48)
                tokens += [rng.randrange(vocab) for _ in range(n)]
                mask += [1] * n
            out.append(_sequence(TrainSequence, tokens, mask, rng))
    return out


def _sequence(cls: Any, tokens: list[int], mask: list[int], rng: random.Random) -> Any:
    behav = [-rng.uniform(1.0, 4.0) * m for m in mask]
    advantage = rng.choice((-1.0, 1.0))
    return cls(
        tokens=tokens,
        loss_mask=mask,
        behav_logprobs=behav,
        prox_logprobs=behav,
        advantages=[advantage * m for m in mask],
        versions=[0 if m else -1 for m in mask],
    )


def bench(model_dir: Path, seqs: list[Any], budget: int, rounds: int) -> dict[str, Any]:
    from trainer.algorithms.config import algorithm_config
    from trainer.backends.fsdp import FSDPBackend
    from trainer.batch import plan_rows
    from trainer.loss import make_loss_fn

    algo = algorithm_config("grpo")
    loss_fn = make_loss_fn(algo)
    norm = float(sum(s.num_loss_tokens for s in seqs))
    backends = {
        sharing: FSDPBackend(model_dir, lr=1e-6, prefix_sharing=sharing)
        for sharing in (False, True)
    }
    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(rounds + 1):
        order = [False, True] if r % 2 else [True, False]  # neither always runs first
        for sharing in order:
            backend = backends[sharing]
            start = time.perf_counter()
            backend.train_step(
                seqs, loss_fn, temperature=1.0, token_budget=budget, global_norm=norm
            )
            if r:  # the first round warms up
                times[sharing].append(time.perf_counter() - start)
    positions = {
        sharing: sum(
            len(seqs[m.seq]) - m.shared
            for row in plan_rows(seqs, budget, prefix_sharing=sharing)
            for m in row
        )
        for sharing in (False, True)
    }
    return {"times": times, "positions": positions, "tokens": sum(len(s) for s in seqs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", nargs="+", default=["tiny"], help="tiny, smollm2 or a directory")
    ap.add_argument("--shape", nargs="+", default=["grpo", "multiturn"])
    ap.add_argument("--groups", type=int, default=1)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--answer", type=int, default=64)
    ap.add_argument("--multiturn-prompt", type=int, default=80)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--token-budget", type=int, default=2048)
    args = ap.parse_args()
    from transformers import AutoConfig

    from rlgateway.models import resolve_model

    print(
        "| model | shape | sequences | tokens | flat positions | tree positions "
        "| flat s/step | tree s/step | flat tokens/s | tree tokens/s | tree / flat |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.model:
        model_dir = resolve_model(name, Path.cwd())
        vocab = min(AutoConfig.from_pretrained(str(model_dir)).vocab_size, 256)
        for shape in args.shape:
            rng = random.Random(0)
            if shape == "grpo":
                seqs = grpo_batch(
                    args.groups, args.group_size, args.prompt, args.answer, vocab, rng
                )
            else:
                seqs = multiturn_batch(
                    args.groups, args.group_size, args.multiturn_prompt, vocab, rng
                )
            out = bench(model_dir, seqs, args.token_budget, args.rounds)
            flat, tree = (statistics.median(out["times"][k]) for k in (False, True))
            n = out["tokens"]
            print(
                f"| {name} | {shape} | {len(seqs)} | {n:,} | {out['positions'][False]:,} "
                f"| {out['positions'][True]:,} | {flat:.2f} | {tree:.2f} | {n / flat:,.0f} "
                f"| {n / tree:,.0f} | {flat / tree:.2f}x |",
                flush=True,
            )


if __name__ == "__main__":
    main()
