"""A fixed parallel run, shared by the test process (one rank, `fsdp` or `archon`) and the processes
that torchrun starts (`fsdp:t2`, `fsdp:d2t2`, `fsdp:c2`, `archon:e2`, ...), so that the two can be
compared.

From the repository root, `PYTHONPATH=. python -m torch.distributed.run --nproc-per-node 2
tests/support/workers/tp_worker.py MODEL OUT ALLOC` runs `run(MODEL, ALLOC, OUT/ckpt)` on every rank
and writes each rank's result to OUT/rank{r}.pt (`torch.save`; the full state dicts are rank 0's
only, {} elsewhere).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from engines.weights import save_shards
from tests.support.workers.fsdp_worker import (
    STEPS,
    TEMPERATURE,
    TOKEN_BUDGET,
    build_backend,
    make_sequences,
)
from trainer.backends.fsdp import FSDPBackend
from trainer.backends.fsdp_value import FSDPValueBackend
from trainer.batch import MicroBatch, TrainSequence
from trainer.parallel.strategy import parse_allocation
from trainer.weights import ShardedWeights, serve_weight_passes

AUX_LOSS_COEF = 0.05
"""Weight of the MoE router's balance loss under the archon backend: large enough to move it."""

ENTROPY_COEF = 0.1
"""Weight of the entropy bonus: large enough that its gradient moves the weights visibly."""


def entropy_bonus_loss(
    logp_1T: torch.Tensor, mb: MicroBatch, normalizer: float, entropy_1T: torch.Tensor | None
) -> tuple[torch.Tensor, Mapping[str, float]]:
    """Policy gradient minus an entropy bonus, over trained tokens / normalizer; reports the mean
    logprob and entropy of the trained tokens."""
    assert entropy_1T is not None
    mask = mb.loss_mask_1T
    pg = -(logp_1T * mb.advantages_1T * mask).sum()
    loss = (pg - ENTROPY_COEF * (entropy_1T * mask).sum()) / normalizer
    n = max(1, mb.num_loss_tokens)
    logp = float((logp_1T.detach() * mask).sum()) / n
    return loss, {"logp": logp, "entropy": float((entropy_1T.detach() * mask).sum()) / n}


def value_loss(
    values_1T: torch.Tensor, mb: MicroBatch, normalizer: float, entropy_1T: torch.Tensor | None
) -> tuple[torch.Tensor, Mapping[str, float]]:
    """Squared error of the values against the advantages (any fixed target will do)."""
    mask = mb.loss_mask_1T
    return ((values_1T - mb.advantages_1T) ** 2 * mask).sum() / normalizer, {}


def step(backend: FSDPBackend, seqs: list[TrainSequence]) -> dict[str, float]:
    return backend.train_step(
        seqs,
        entropy_bonus_loss,
        temperature=TEMPERATURE,
        token_budget=TOKEN_BUDGET,
        global_norm=float(sum(s.num_loss_tokens for s in seqs)),
        entropy="loss",
    )


def backend_settings(allocation: str) -> dict[str, Any]:
    """The backend's own settings in these runs: the MoE backend weights its balance loss with
    `AUX_LOSS_COEF`, so that its gradient takes part in every comparison."""
    if parse_allocation(allocation).backend == "archon":
        return {"aux_loss_coef": AUX_LOSS_COEF}
    return {}


PUBLISH_BUCKET_BYTES = 64 << 10
"""Buckets of the weight publish: small enough that the tiny models go in several."""


def publish(backend: FSDPBackend, out: Path, model_dir: str | Path) -> Path:
    """The weights published to disk as `rlgateway train` publishes them: rank 0 writes each
    bucket as the ranks gather it, the other ranks serving the passes."""
    if backend.rank == 0:
        with ShardedWeights(backend) as weights:
            save_shards(weights.buckets(PUBLISH_BUCKET_BYTES), out, Path(model_dir))
    else:
        serve_weight_passes(backend)
    return out


SCORE_RTOL = 1e-5
"""float32 scores summed in another order differ relative to their size: a logprob of -4.5 by
1.3e-5 (3e-6 relative) on a CPU whose kernels accumulate in another order (measured)."""

PARAM_ATOL = 5e-5
"""Weights after `STEPS` Adam steps, float32: Adam divides each gradient by its own running RMS,
so a component whose gradient is near zero moves by up to lr per step on rounding alone
(measured 1.14e-5 on one CPU, where lr peaks at 7.5e-5); a wrong shard moves the weights by the
whole update and changes the scores far beyond `SCORE_RTOL`."""


def check_scores_match(
    one_process: dict[str, Any], ranks: list[dict[str, Any]], key: str, atol: float
) -> None:
    """Every rank has the full `key` scores (logprobs, critic values) of one process's run."""
    for r in ranks:
        for ours, theirs in zip(one_process[key], r[key], strict=True):
            torch.testing.assert_close(
                torch.tensor(theirs), torch.tensor(ours), atol=atol, rtol=SCORE_RTOL
            )


def check_resumes_exactly(rank0: dict[str, Any]) -> None:
    """The run resumed from its checkpoint took the last step bit for bit, and the export path
    reads the sharded DCP files in one process into the full weights saved with it."""
    from trainer.export import read_weights

    assert rank0["resumed_stats"] == rank0["stats"][-1]
    a, b = rank0["state"], rank0["resumed_state"]
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    exported, saved = read_weights(Path(rank0["checkpoint"])), rank0["saved_state"]
    assert exported.keys() == saved.keys()
    assert all(torch.equal(exported[k], saved[k]) for k in saved)


def check_published(rank0: dict[str, Any]) -> None:
    """Rank 0's published directory holds its full state dict bit for bit, in several files
    that transformers loads."""
    from transformers import AutoModelForCausalLM

    from engines.weights import read_dir

    published, state = Path(rank0["published"]), rank0["state"]
    files = sorted(published.glob("*.safetensors"))
    assert len(files) > 1
    assert (published / "model.safetensors.index.json").is_file()
    on_disk = read_dir(published)
    assert on_disk.keys() == state.keys()
    assert all(torch.equal(on_disk[k], state[k]) for k in state)
    loaded = AutoModelForCausalLM.from_pretrained(str(published), dtype=torch.float32)
    assert all(torch.equal(v, state[k]) for k, v in loaded.state_dict().items())


def run(
    model_dir: str | Path,
    allocation: str,
    checkpoint: Path | None,
    seqs: list[TrainSequence] | None = None,
    *,
    critic: bool = True,
) -> dict[str, Any]:
    """`STEPS` steps of the policy on `seqs` (default `make_sequences()`), its logprobs and
    weights after them, then (with `critic`) one step of a critic and its values. With a
    `checkpoint`, one saved (with the full state dict) before the last step, and the last step
    again from it in a new backend."""
    seqs = make_sequences() if seqs is None else seqs
    extra = backend_settings(allocation)
    backend = build_backend(model_dir, allocation, **extra)
    stats = [step(backend, seqs) for _ in range(STEPS - 1)]
    result: dict[str, Any] = {}
    if checkpoint is not None:
        backend.save(checkpoint)
        # a copy: on CPU, tensors that need no gathering come back as the live parameters' storage
        saved_state = {k: v.clone() for k, v in backend.full_state_dict().items()}
        result |= {"checkpoint": str(checkpoint), "saved_state": saved_state}
    stats.append(step(backend, seqs))
    if checkpoint is not None:
        result["published"] = str(publish(backend, checkpoint.parent / "published", model_dir))
    result |= {
        "world_size": backend.world_size,
        "dp_size": backend.dp_size,
        "stats": stats,
        "logprobs": backend.forward_logprobs(seqs, TEMPERATURE, token_budget=TOKEN_BUDGET),
        "state": backend.full_state_dict(),
    }
    del backend

    if checkpoint is not None:
        resumed = build_backend(model_dir, allocation, **extra)
        resumed.load(checkpoint)
        result["resumed_stats"] = step(resumed, seqs)
        result["resumed_state"] = resumed.full_state_dict()
        del resumed
    if not critic:
        return result

    value = build_backend(model_dir, allocation, value=True, **extra)
    assert isinstance(value, FSDPValueBackend)
    norm = float(sum(s.num_loss_tokens for s in seqs))
    result["critic_stats"] = value.train_step(
        seqs, value_loss, temperature=1.0, token_budget=TOKEN_BUDGET, global_norm=norm
    )
    result["critic_values"] = value.forward_values(seqs, token_budget=TOKEN_BUDGET)
    return result


def main(model_dir: str, out: str, allocation: str) -> None:
    import torch.distributed as dist

    result = run(model_dir, allocation, Path(out) / "ckpt")
    torch.save(result, Path(out) / f"rank{dist.get_rank()}.pt")


if __name__ == "__main__":
    from tests.support.torchrun import exit_worker

    main(*sys.argv[1:])
    exit_worker()
