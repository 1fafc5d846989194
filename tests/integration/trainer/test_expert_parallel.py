"""The MoE backend (`archon`) on CPU: expert parallelism over gloo processes, the router's balance
loss and its statistics, on the tiny Qwen3-MoE (4 experts, top-2, 2 layers).

- `archon:e2` (2 ranks: 2 data ranks, the experts split over both, no expert FSDP) and
  `archon:d4e2` (4 ranks: 2 expert groups of 2, each expert's weights FSDP-sharded over the 2
  ranks that hold it) train to the weights of one process under `archon` (losses, grad norms,
  entropies, router statistics, parameters, logprobs and a critic's values to float32
  tolerance), with the balance loss weighted into every step; their DCP checkpoints resume bit
  for bit and export to the full weights (the runs: tests/support/workers/tp_worker.py).
- One process under `archon` with the balance loss off trains as `fsdp` does with transformers'
  own experts: the dispatch and combine compute transformers' MoE layer.
- The balance loss equals a float64 reference computed from transformers' router logits
  sequence by sequence; its weight `aux_loss_coef` changes the loss by exactly that much and
  moves the weights; every token reaches its k experts (the counts add up, nothing dropped).
- A strategy or model the backend cannot train is refused, naming the rule.
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
from tests.support.workers import fsdp_worker, tp_worker
from trainer.backends.archon import ArchonBackend
from trainer.backends.config import ArchonBackendConfig
from trainer.batch import TrainSequence
from trainer.parallel.strategy import parse_allocation

pytestmark = pytest.mark.slow

ATOL = 1e-5
"""1 process vs expert ranks, float32: the ranks sum the dense gradients in another order."""

RUNS = {"archon:e2": (2, 2), "archon:d4e2": (4, 4)}
"""Allocation -> (processes, data ranks)."""


@pytest.fixture(scope="module")
def moe_model() -> Path:
    return tiny_model_dir(moe=True)


@pytest.fixture(scope="module")
def one_process(moe_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The worker's run in this process: `archon`, every expert local."""
    return tp_worker.run(moe_model, "archon", tmp_path_factory.mktemp("one") / "ckpt")


@dataclass(frozen=True)
class Run:
    one_process: dict[str, Any]
    ranks: list[dict[str, Any]]
    """Every rank's result of the expert-parallel run."""


@pytest.fixture(scope="module", params=list(RUNS))
def run(
    request: pytest.FixtureRequest,
    moe_model: Path,
    one_process: dict[str, Any],
    tmp_path_factory: pytest.TempPathFactory,
) -> Run:
    allocation = request.param
    nproc, dp_size = RUNS[allocation]
    out = tmp_path_factory.mktemp(allocation.replace(":", "-"))
    torchrun(tp_worker.__file__, [str(moe_model), str(out), allocation], nproc=nproc)
    results = [torch.load(out / f"rank{r}.pt") for r in range(nproc)]
    assert [(r["world_size"], r["dp_size"]) for r in results] == [(nproc, dp_size)] * nproc
    return Run(one_process, results)


def test_expert_ranks_train_the_same_weights_as_one_process(run: Run, moe_model: Path) -> None:
    one_process, ranks = run.one_process, run.ranks
    state = ranks[0]["state"]
    # full_state_dict: plain full tensors with Hugging Face names (the experts' fused layout)
    assert all(r["state"] == {} for r in ranks[1:])
    initial = AutoModelForCausalLM.from_pretrained(str(moe_model), dtype=torch.float32)
    assert state.keys() == initial.state_dict().keys()
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 384, 128)
    assert all(type(v) is torch.Tensor for v in state.values())

    diff = max_abs_diff(one_process["state"], state)
    print(f"max |param(archon) - param(expert parallel)| after {tp_worker.STEPS} steps: {diff:.3g}")
    assert diff <= tp_worker.PARAM_ATOL
    assert max_abs_diff(one_process["state"], initial.state_dict()) > 1e-4  # it trained
    # the experts' weights moved as well as the router's
    name = "model.layers.1.mlp.experts.down_proj"
    assert float((state[name] - initial.state_dict()[name]).abs().max()) > 1e-4
    for one, other in zip(one_process["stats"], ranks[0]["stats"], strict=True):
        assert other.keys() == one.keys() >= {"loss", "grad_norm", "moe_balance_loss"}
        assert other == pytest.approx(one, rel=1e-5)
    assert all(r["stats"] == ranks[0]["stats"] for r in ranks)
    tp_worker.check_scores_match(one_process, ranks, "logprobs", ATOL)


def test_an_expert_parallel_checkpoint_resumes_exactly_and_exports(run: Run) -> None:
    tp_worker.check_resumes_exactly(run.ranks[0])


def test_expert_sharded_weights_are_published_a_bucket_at_a_time(run: Run) -> None:
    # rank 0 wrote each bucket as the ranks gathered it; the state is the full one, bit for bit
    tp_worker.check_published(run.ranks[0])
    tp_worker.check_published(run.one_process)


def test_an_expert_parallel_critic_matches_one_process(run: Run) -> None:
    for r in run.ranks:
        assert r["critic_stats"] == pytest.approx(run.one_process["critic_stats"], rel=1e-5)
    tp_worker.check_scores_match(run.one_process, run.ranks, "critic_values", ATOL)


def test_the_dispatch_computes_transformers_moe_layer(moe_model: Path) -> None:
    seqs = fsdp_worker.make_sequences()
    ours = fsdp_worker.build_backend(moe_model, "archon")
    theirs = fsdp_worker.build_backend(moe_model, "fsdp")  # transformers' eager experts
    ours_stats, theirs_stats = fsdp_worker.train(ours, seqs), fsdp_worker.train(theirs, seqs)
    for a, b in zip(ours_stats, theirs_stats, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    assert max_abs_diff(ours.full_state_dict(), theirs.full_state_dict()) <= ATOL


def reference_balance_loss(model_dir: Path, seqs: list[TrainSequence]) -> float:
    """`trainer.moe`'s balance loss written out in float64 from transformers' router logits, one
    sequence at a time: the mean over sequences of the mean over layers of sum_e f_e P_e."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float64)
    experts, k = model.config.num_experts, model.config.num_experts_per_tok
    per_seq = []
    with torch.no_grad():
        for seq in seqs:
            out = model(input_ids=torch.tensor([seq.tokens]), output_router_logits=True)
            layers = []
            for logits in out.router_logits:  # [T, E] per layer
                probs = torch.softmax(logits, dim=-1)
                chosen = torch.zeros_like(probs)
                for t, row in enumerate(probs.topk(k, dim=-1).indices):
                    chosen[t, row] = 1.0
                f = chosen.sum(0) * experts / (k * len(seq.tokens))
                layers.append(float((f * probs.mean(0)).sum()))
            per_seq.append(sum(layers) / len(layers))
    return sum(per_seq) / len(per_seq)


def test_the_balance_loss_and_its_weight(moe_model: Path) -> None:
    seqs = fsdp_worker.make_sequences()
    norm = float(sum(s.num_loss_tokens for s in seqs))
    coef = tp_worker.AUX_LOSS_COEF

    def first_step(aux_loss_coef: float) -> tuple[ArchonBackend, dict[str, float]]:
        backend = fsdp_worker.build_backend(moe_model, "archon", aux_loss_coef=aux_loss_coef)
        assert isinstance(backend, ArchonBackend)
        stats = backend.train_step(
            seqs,
            fsdp_worker.policy_gradient_loss,
            temperature=fsdp_worker.TEMPERATURE,
            token_budget=fsdp_worker.TOKEN_BUDGET,
            global_norm=norm,
        )
        return backend, stats

    off, off_stats = first_step(0.0)
    on, on_stats = first_step(coef)
    reference = reference_balance_loss(moe_model, seqs)
    print(f"balance loss {on_stats['moe_balance_loss']:.6f}, float64 reference {reference:.6f}")
    assert off_stats["moe_balance_loss"] == pytest.approx(reference, rel=1e-5)
    assert on_stats["moe_balance_loss"] == pytest.approx(reference, rel=1e-5)
    assert reference > 1.0  # the tiny router is not perfectly balanced
    # the weight adds exactly coef x the balance loss, and its gradient moves the weights
    assert on_stats["loss"] - off_stats["loss"] == pytest.approx(coef * reference, rel=1e-4)
    assert on_stats["grad_norm"] != pytest.approx(off_stats["grad_norm"], rel=1e-4)
    gate = "model.layers.0.mlp.gate.weight"
    assert float((on.full_state_dict()[gate] - off.full_state_dict()[gate]).abs().max()) > 1e-6

    # router statistics: dropless, every token reaches its k experts in every layer
    counts = on.router_counts
    assert counts.shape == (2, 4)
    tokens = sum(len(s) for s in seqs)
    assert counts.sum(1).tolist() == [tokens * 2, tokens * 2]
    load = counts.double() / counts.double().mean(1, keepdim=True)
    assert on_stats["moe_load_min"] == pytest.approx(float(load.min()))
    assert on_stats["moe_load_max"] == pytest.approx(float(load.max()))
    assert on_stats["moe_load_min"] < 1.0 < on_stats["moe_load_max"]


def test_what_the_moe_backend_cannot_train_is_refused(moe_model: Path, tiny_model: Path) -> None:
    dense = "archon backend trains qwen3_moe models; this one is 'qwen2'"
    with pytest.raises(ValueError, match=dense):
        ArchonBackend(tiny_model)
    with pytest.raises(ValueError, match="archon: tensor parallel is not implemented yet"):
        ArchonBackendConfig(model_dir=str(moe_model), allocation=parse_allocation("archon:t2"))
    with pytest.raises(ValueError, match="expert size 4 must divide data x context = 2"):
        parse_allocation("archon:d2e4")
    with pytest.raises(ValueError, match="allocation names 'fsdp': use archon"):
        ArchonBackendConfig(model_dir=str(moe_model), allocation=parse_allocation("fsdp"))
    with pytest.raises(ValueError, match="4 experts do not divide by 3"):
        ArchonBackend(moe_model, allocation=parse_allocation("archon:d3e3"))
