"""A fixed prefix-shared FSDP run, shared by the test process and the processes torchrun starts.

`python -m torch.distributed.run --nproc-per-node 2 tests/support/workers/prefix_worker.py MODEL
OUT` trains `train`'s two decoupled-PPO steps on `group_sequences()` with `prefix_sharing` on,
then has rank 0 write the full state dict and the per-step stats to OUT (`torch.save`).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import torch

from tests.support.workers.fsdp_worker import build_backend
from trainer.algorithms.config import algorithm_config
from trainer.batch import TrainSequence
from trainer.loss import make_loss_fn

TOKEN_BUDGET = 160
GROUPS, SIZE, PROMPT = 3, 6, 40
TEMPERATURE = 0.8


def group_sequences(*, returns: bool = False) -> list[TrainSequence]:
    """GRPO groups: `SIZE` answers (1 to 30 tokens) to each of `GROUPS` random prompts of
    `PROMPT` tokens, interleaved; per-token temperatures, behaviour and proximal logprobs and
    advantages that differ per answer; with `returns`, a critic's values and returns too."""
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(PROMPT)] for _ in range(GROUPS)]
    out = []
    for _ in range(SIZE):
        for g in range(GROUPS):
            answer = [rng.randrange(256) for _ in range(rng.randint(1, 30))]
            mask = [0] * PROMPT + [1] * len(answer)
            advantage = rng.choice((-1.0, -0.5, 0.5, 1.0))

            def per_token(lo: float, hi: float) -> list[float]:
                return [rng.uniform(lo, hi) * m for m in mask]  # noqa: B023

            out.append(
                TrainSequence(
                    tokens=prompts[g] + answer,
                    loss_mask=mask,
                    behav_logprobs=per_token(-6.0, -4.0),
                    prox_logprobs=per_token(-6.0, -4.0),
                    advantages=[advantage * m for m in mask],
                    versions=[2 if m else -1 for m in mask],
                    temperatures=[TEMPERATURE] * len(mask),
                    values=per_token(-1.0, 1.0) if returns else None,
                    returns=per_token(-1.0, 1.0) if returns else None,
                )
            )
    return out


def train(backend: Any, seqs: list[TrainSequence]) -> dict[str, Any]:
    """Two steps of decoupled PPO with an entropy bonus (GRPO's preset), token-mean; then the
    trained weights, the stats and the sequences' logprobs."""
    initial = {k: v.clone() for k, v in backend.full_state_dict().items()}
    algo = algorithm_config("grpo", entropy_coef=0.01)
    loss_fn = make_loss_fn(algo)
    norm = float(sum(s.num_loss_tokens for s in seqs))
    stats = [
        backend.train_step(
            seqs,
            loss_fn,
            temperature=TEMPERATURE,
            token_budget=TOKEN_BUDGET,
            global_norm=norm,
            entropy=algo.entropy_mode,
        )
        for _ in range(2)
    ]
    return {
        "initial": initial,
        "state": backend.full_state_dict(),
        "stats": stats,
        "logprobs": backend.forward_logprobs(seqs, TEMPERATURE, token_budget=TOKEN_BUDGET),
    }


def main(model_dir: str, out: str) -> None:
    backend = build_backend(model_dir, prefix_sharing=True)
    result = train(backend, group_sequences())
    if backend.rank == 0:
        del result["initial"]
        torch.save(result | {"world_size": backend.world_size}, Path(out))


if __name__ == "__main__":
    from tests.support.torchrun import exit_worker

    main(*sys.argv[1:])
    exit_worker()
