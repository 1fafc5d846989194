"""Tensor parallelism in the FSDP2 backend on CPU: gloo processes under `fsdp:t2` (2 ranks, one
data rank) and `fsdp:d2t2` (4 ranks, 2 data ranks of 2 tensor ranks) train a Qwen2 (and under
`fsdp:t2` a Qwen3, whose per-head q/k norms take the partial-gradient path) to the same weights
as one process under `fsdp` (losses, entropies, grad norms, parameters, logprobs and a critic's
values to 1e-5, every rank with the full scores); their DCP checkpoint resumes exactly and
exports to the full weights; and a model whose heads the tensor size does not divide is refused
when the backend is built (the runs: tests/support/workers/tp_worker.py).

The test model has one key-value head, so the Qwen2 runs use the tiny demo-sized model (4 heads, 2
key-value heads); both models have the tiny 263-id vocabulary, which splits unevenly (132 + 131).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from engines.tiny_model import tiny_model_dir
from tests.support.parallel_models import build_tiny_qwen3
from tests.support.torchrun import max_abs_diff, torchrun
from tests.support.workers import tp_worker
from trainer.backends.fsdp import FSDPBackend
from trainer.parallel.strategy import parse_allocation

pytestmark = pytest.mark.slow

ATOL = 1e-5
"""1 process vs tensor ranks, float32: the tensor ranks sum the matmuls' and the softmax's parts
in another order."""

RUNS = {
    "qwen2 fsdp:t2": ("qwen2", "fsdp:t2", 2, 1),
    "qwen2 fsdp:d2t2": ("qwen2", "fsdp:d2t2", 4, 2),
    "qwen3 fsdp:t2": ("qwen3", "fsdp:t2", 2, 1),
}
"""Run id -> (model, allocation, processes, data ranks)."""


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny demo-sized Qwen2 and a tiny Qwen3."""
    qwen3 = build_tiny_qwen3(tmp_path_factory.mktemp("qwen3"))
    return {"qwen2": tiny_model_dir(size="demo", seed=0), "qwen3": qwen3}


@pytest.fixture(scope="module")
def one_process(
    models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict[str, Any]]:
    """The worker's run of each model in this process (a process group of one, data parallel)."""
    return {
        name: tp_worker.run(model, "fsdp", tmp_path_factory.mktemp(f"one-{name}") / "ckpt")
        for name, model in models.items()
    }


@dataclass(frozen=True)
class Run:
    model: Path
    one_process: dict[str, Any]
    """The same run in one process."""
    ranks: list[dict[str, Any]]
    """Every rank's result of the tensor-parallel run."""


@pytest.fixture(scope="module", params=list(RUNS))
def run(
    request: pytest.FixtureRequest,
    models: dict[str, Path],
    one_process: dict[str, dict[str, Any]],
    tmp_path_factory: pytest.TempPathFactory,
) -> Run:
    """The worker's run under torchrun with a tensor-parallel allocation."""
    name, allocation, nproc, dp_size = RUNS[request.param]
    out = tmp_path_factory.mktemp(request.param.replace(":", "-").replace(" ", "-"))
    torchrun(tp_worker.__file__, [str(models[name]), str(out), allocation], nproc=nproc)
    results = [torch.load(out / f"rank{r}.pt") for r in range(nproc)]
    assert [(r["world_size"], r["dp_size"]) for r in results] == [(nproc, dp_size)] * nproc
    return Run(models[name], one_process[name], results)


def test_tensor_ranks_train_the_same_weights_as_one_process(run: Run) -> None:
    one_process, ranks = run.one_process, run.ranks
    rank0 = ranks[0]
    # full_state_dict: plain full tensors with Hugging Face names, on rank 0 only
    state = rank0["state"]
    assert all(r["state"] == {} for r in ranks[1:])
    assert all(type(v) is torch.Tensor and v.device.type == "cpu" for v in state.values())
    initial = AutoModelForCausalLM.from_pretrained(str(run.model), dtype=torch.float32)
    assert state["lm_head.weight"].shape == (263, initial.config.hidden_size)

    diff = max_abs_diff(one_process["state"], state)
    print(f"max |param(fsdp) - param(tensor parallel)| after {tp_worker.STEPS} steps: {diff:.3g}")
    assert diff <= tp_worker.PARAM_ATOL
    assert max_abs_diff(one_process["state"], initial.state_dict()) > 1e-4  # it trained
    # the unclipped grad norm (clipping is on), loss, mean logprob and entropy of every step
    for one, other in zip(one_process["stats"], rank0["stats"], strict=True):
        assert other.keys() == one.keys() >= {"loss", "grad_norm", "entropy", "logp", "lr"}
        assert other == pytest.approx(one, rel=1e-5)
    assert all(r["stats"] == rank0["stats"] for r in ranks)
    # forward_logprobs: every rank has the full result
    tp_worker.check_scores_match(one_process, ranks, "logprobs", ATOL)


def test_a_tensor_parallel_checkpoint_resumes_exactly_and_exports(run: Run) -> None:
    tp_worker.check_resumes_exactly(run.ranks[0])


def test_tensor_sharded_weights_are_published_a_bucket_at_a_time(run: Run) -> None:
    # rank 0 wrote each bucket as the ranks gathered it; the state is the full one, bit for bit
    tp_worker.check_published(run.ranks[0])
    tp_worker.check_published(run.one_process)


def test_a_tensor_parallel_critic_matches_one_process(run: Run) -> None:
    one_process = run.one_process
    for r in run.ranks:
        assert r["critic_stats"] == pytest.approx(one_process["critic_stats"], rel=1e-5)
    tp_worker.check_scores_match(one_process, run.ranks, "critic_values", ATOL)


def test_heads_that_the_tensor_size_does_not_divide_are_refused(tiny_model: Path) -> None:
    # the test model has 2 attention heads and 1 key-value head; refused before any weights load
    with pytest.raises(ValueError, match="1 key-value heads do not divide by 2"):
        FSDPBackend(tiny_model, allocation=parse_allocation("fsdp:t2"))
