"""Context parallelism (Ulysses) in the FSDP2 backend on CPU: gloo processes under `fsdp:c2` (2
ranks, one data rank), `fsdp:d2c2` (4 ranks, 2 data ranks of 2 context ranks) and `fsdp:c2t2` (4
ranks, a context group of 2 for each of 2 tensor ranks) train a policy to the same weights as one
process under `fsdp`, on packed rows of several sequences, of odd length and with sequences
that cross the slice boundary (losses, entropies, grad norms, parameters, logprobs and a
critic's values to 1e-5, every rank with the full scores; the runs:
tests/support/workers/cp_worker.py).

The test model (2 heads, 1 key-value head) repeats its key-value head for the 2 context ranks;
under `fsdp:c2t2` the demo-sized model (4 heads, 2 key-value heads) has 2 heads and 1 key-value
head per tensor rank, split and repeated likewise.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from engines.tiny_model import tiny_model_dir
from tests.support.torchrun import max_abs_diff, torchrun
from tests.support.workers import cp_worker, tp_worker
from tests.support.workers.fsdp_worker import STEPS
from trainer.backends.fsdp import FSDPBackend
from trainer.parallel.strategy import parse_allocation

pytestmark = pytest.mark.slow

ATOL = 1e-5
"""1 process vs context ranks, float32: the slices' matmuls and the gathered rows sum in another
order."""

RUNS = {
    "fsdp:c2": ("test", "fsdp:c2", 2, 1),
    "fsdp:d2c2": ("test", "fsdp:d2c2", 4, 2),
    "fsdp:c2t2": ("demo", "fsdp:c2t2", 4, 1),
}
"""Run id -> (tiny model size, allocation, processes, data ranks)."""


@pytest.fixture(scope="module")
def one_process() -> dict[str, dict[str, Any]]:
    """The worker's run of each model in this process (a process group of one, data parallel)."""
    out: dict[str, dict[str, Any]] = {}
    for size in sorted({size for size, *_ in RUNS.values()}):
        out[size] = cp_worker.run(tiny_model_dir(size=size, seed=0), "fsdp")
    return out


@dataclass(frozen=True)
class Run:
    model: Path
    one_process: dict[str, Any]
    """The same run in one process."""
    ranks: list[dict[str, Any]]
    """Every rank's result of the context-parallel run."""


@pytest.fixture(scope="module", params=list(RUNS))
def run(
    request: pytest.FixtureRequest,
    one_process: dict[str, dict[str, Any]],
    tmp_path_factory: pytest.TempPathFactory,
) -> Run:
    """The worker's run under torchrun with a context-parallel allocation."""
    size, allocation, nproc, dp_size = RUNS[request.param]
    model = tiny_model_dir(size=size, seed=0)
    out = tmp_path_factory.mktemp(request.param.replace(":", "-"))
    torchrun(cp_worker.__file__, [str(model), str(out), allocation], nproc=nproc)
    results = [torch.load(out / f"rank{r}.pt") for r in range(nproc)]
    assert [(r["world_size"], r["dp_size"]) for r in results] == [(nproc, dp_size)] * nproc
    return Run(model, one_process[size], results)


def test_context_ranks_train_the_same_weights_as_one_process(run: Run) -> None:
    one_process, ranks = run.one_process, run.ranks
    rank0 = ranks[0]
    state = rank0["state"]
    assert all(r["state"] == {} for r in ranks[1:])
    diff = max_abs_diff(one_process["state"], state)
    print(f"max |param(fsdp) - param(context parallel)| after {STEPS} steps: {diff:.3g}")
    assert diff <= tp_worker.PARAM_ATOL
    initial = AutoModelForCausalLM.from_pretrained(str(run.model), dtype=torch.float32)
    assert max_abs_diff(one_process["state"], initial.state_dict()) > 1e-4  # it trained
    # the unclipped grad norm (clipping is on), loss, mean logprob and entropy of every step
    for one, other in zip(one_process["stats"], rank0["stats"], strict=True):
        assert other.keys() == one.keys() >= {"loss", "grad_norm", "entropy", "logp", "lr"}
        assert other == pytest.approx(one, rel=1e-5)
    assert all(r["stats"] == rank0["stats"] for r in ranks)
    # forward_logprobs: every rank has the full result, of every token
    tp_worker.check_scores_match(one_process, ranks, "logprobs", ATOL)


def test_a_context_parallel_critic_matches_one_process(run: Run) -> None:
    one_process = run.one_process
    for r in run.ranks:
        assert r["critic_stats"] == pytest.approx(one_process["critic_stats"], rel=1e-5)
    tp_worker.check_scores_match(one_process, run.ranks, "critic_values", ATOL)


def test_heads_that_the_context_size_does_not_divide_are_refused(tiny_model: Path) -> None:
    # the test model has 2 attention heads; refused before any weights load
    with pytest.raises(ValueError, match="2 heads do not divide by tensor x context = 4"):
        FSDPBackend(tiny_model, allocation=parse_allocation("fsdp:c4"))


def test_context_parallel_needs_the_varlen_attention(tiny_model: Path) -> None:
    with pytest.raises(ValueError, match="context parallel c2 runs Ulysses attention"):
        FSDPBackend(tiny_model, attention="sdpa", allocation=parse_allocation("fsdp:c2"))
