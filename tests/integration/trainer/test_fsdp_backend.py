"""The FSDP2 training backend on CPU: it learns, its weights load into a plain HF model, it resumes
exactly from a checkpoint, and two processes under torchrun train the same weights as one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoModelForCausalLM

from tests.support.torchrun import max_abs_diff, torchrun
from tests.support.workers import fsdp_worker
from tests.support.workers.fsdp_worker import (
    TEMPERATURE,
    TOKEN_BUDGET,
    build_backend,
    make_sequences,
)
from trainer.backends.config import FSDPBackendConfig
from trainer.backends.fsdp import FSDPBackend, LRSchedule
from trainer.backends.registry import build_backend as build_backend_from_config
from trainer.batch import plan_micro_batches

pytestmark = pytest.mark.slow

PARAM_ATOL = 1e-5
"""1 vs 2 processes: float summation order differs, and Adam magnifies that on tiny gradients."""


def hf_model(model_dir: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def hf_logprobs(model: Any, tokens: list[int], temperature: float) -> list[float]:
    """Teacher-forced logprob of each token from a plain HF forward (0 for the first token)."""
    ids = torch.tensor([tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1]
    logp = torch.log_softmax(logits / temperature, -1).gather(-1, ids[0, 1:, None])[:, 0]
    return [0.0, *logp.tolist()]


@pytest.fixture(scope="module")
def one_process(tiny_model: Path) -> dict[str, Any]:
    """The worker's run in this process (a process group of one)."""
    backend = build_backend(tiny_model)
    seqs = make_sequences()
    stats = fsdp_worker.train(backend, seqs)
    logprobs = backend.forward_logprobs(seqs, TEMPERATURE, token_budget=TOKEN_BUDGET)
    return {
        "backend": backend,
        "stats": stats,
        "state": backend.full_state_dict(),
        "logprobs": logprobs,
    }


def test_training_reduces_the_loss(one_process: dict[str, Any]) -> None:
    stats = one_process["stats"]
    losses = [s["loss"] for s in stats]
    assert losses[-1] < losses[0] - 0.5, losses
    assert all(torch.isfinite(torch.tensor(s["grad_norm"])) for s in stats)
    # Warmup of 1 step, then cosine decay to 0 over the remaining 3 of 4 total steps.
    assert [s["lr"] for s in stats] == pytest.approx([1e-4, 1e-4, 0.75e-4])
    assert one_process["backend"].step == fsdp_worker.STEPS


def test_full_state_dict_is_a_loadable_hf_state_dict(
    one_process: dict[str, Any], tiny_model: Path
) -> None:
    state = one_process["state"]
    model = hf_model(tiny_model)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    assert {k: v.shape for k, v in state.items()} == {k: v.shape for k, v in initial.items()}
    assert all(v.device.type == "cpu" and v.dtype == torch.float32 for v in state.values())
    assert max_abs_diff(state, initial) > 1e-4  # it trained

    model.load_state_dict(state, strict=True)
    for seq, ours in zip(make_sequences(), one_process["logprobs"], strict=True):
        expected = hf_logprobs(model, seq.tokens, TEMPERATURE)
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(expected), atol=1e-5, rtol=0)


def test_forward_logprobs_of_the_initial_weights_match_hf(tiny_model: Path) -> None:
    backend = FSDPBackend(tiny_model)
    seqs = make_sequences(seed=1)
    ours = backend.forward_logprobs(seqs, 1.0, token_budget=32)
    model = hf_model(tiny_model)
    for seq, got in zip(seqs, ours, strict=True):
        expected = hf_logprobs(model, seq.tokens, 1.0)
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), atol=1e-5, rtol=0)


def test_save_and_load_resume_exactly(tiny_model: Path, tmp_path: Path) -> None:
    seqs = make_sequences(seed=2)
    norm = float(sum(s.num_loss_tokens for s in seqs))

    def step(backend: FSDPBackend) -> dict[str, float]:
        return backend.train_step(
            seqs,
            fsdp_worker.policy_gradient_loss,
            temperature=TEMPERATURE,
            token_budget=TOKEN_BUDGET,
            global_norm=norm,
        )

    first = build_backend(tiny_model)
    step(first)
    step(first)
    first.save(tmp_path / "ckpt")
    continued = step(first)

    resumed = build_backend(tiny_model)
    resumed.load(tmp_path / "ckpt")
    assert resumed.step == 2
    after_restart = step(resumed)

    assert after_restart == continued  # loss, grad norm and lr of step 3, bit for bit
    a, b = first.full_state_dict(), resumed.full_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_two_processes_train_the_same_weights_as_one(
    one_process: dict[str, Any], tiny_model: Path, tmp_path: Path
) -> None:
    # The ranks' shares pack into different numbers of micro-batches: one rank runs empty passes.
    seqs = make_sequences()
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
    counts = {
        len(plan_micro_batches([len(seqs[i]) for i in order[r::2]], TOKEN_BUDGET)) for r in (0, 1)
    }
    assert len(counts) == 2

    out = tmp_path / "two.pt"
    torchrun(fsdp_worker.__file__, [str(tiny_model), str(out)])
    two = torch.load(out)
    assert two["world_size"] == 2

    diff = max_abs_diff(one_process["state"], two["state"])
    print(
        f"max |param(1 process) - param(2 processes)| after {fsdp_worker.STEPS} steps: {diff:.3g}"
    )
    assert diff <= PARAM_ATOL
    # Adam is blind to a uniform gradient scale, so hold the unclipped norms and losses too.
    for one, other in zip(one_process["stats"], two["stats"], strict=True):
        assert other == pytest.approx(one, rel=1e-5)
    for ours, theirs in zip(one_process["logprobs"], two["logprobs"], strict=True):
        torch.testing.assert_close(torch.tensor(theirs), torch.tensor(ours), atol=1e-5, rtol=0)


def test_a_zero_learning_rate_trains_nothing(tiny_model: Path) -> None:
    # `optim.lr=0` is the no-train control of an experiment: its steps run (losses, gradient
    # norms) and every weight stays exactly as it was; a positive rate moves them.
    seqs = make_sequences()
    norm = float(sum(s.num_loss_tokens for s in seqs))
    moved = {}
    for lr in (0.0, 1e-3):
        backend = build_backend_from_config(
            FSDPBackendConfig(model_dir=str(tiny_model), lr=lr, weight_decay=0.1)
        )
        before = {k: v.clone() for k, v in backend.full_state_dict().items()}
        stats = backend.train_step(
            seqs,
            fsdp_worker.policy_gradient_loss,
            temperature=TEMPERATURE,
            token_budget=TOKEN_BUDGET,
            global_norm=norm,
        )
        assert stats["grad_norm"] > 0
        assert stats["lr"] == lr
        after = backend.full_state_dict()
        moved[lr] = max_abs_diff(before, after)
    assert moved[0.0] == 0.0, moved
    assert moved[1e-3] > 1e-4, moved


def test_build_backend_from_config(tiny_model: Path) -> None:
    config = FSDPBackendConfig(model_dir=str(tiny_model), lr=1e-5, schedule="linear", total_steps=9)
    backend = build_backend_from_config(config)
    assert isinstance(backend, FSDPBackend)
    assert backend.schedule == LRSchedule("linear", 0, 9)
    with pytest.raises(ValidationError, match="warmup_steps"):
        FSDPBackendConfig(model_dir="m", warmup_steps=5, total_steps=2, schedule="cosine")
    with pytest.raises(ValidationError, match="extra"):
        FSDPBackendConfig.model_validate({"model_dir": "m", "learning_rate": 1.0})
