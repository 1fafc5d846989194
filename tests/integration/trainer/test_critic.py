"""The PPO critic on the FSDP2 backend (CPU): its values are a plain HF token classifier's (the
backend's weights loaded into one) at the logprob alignment, it learns returns, and it resumes
exactly from a checkpoint."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.workers.fsdp_worker import TOKEN_BUDGET, make_sequences
from trainer.algorithms import algorithm_config
from trainer.backends.fsdp_value import FSDPValueBackend, load_value_model
from trainer.batch import TrainSequence
from trainer.loss import make_value_loss_fn
from trainer.sequences import with_gae

pytestmark = pytest.mark.slow


def critic(model_dir: Path, **kw: Any) -> FSDPValueBackend:
    """A critic with a warmup and cosine schedule (so resume must restore the LR)."""
    settings: dict[str, Any] = {
        "lr": 1e-3,
        "warmup_steps": 1,
        "total_steps": 6,
        "schedule": "cosine",
    }
    return FSDPValueBackend(model_dir, **(settings | kw))


def batch_with_targets(backend: FSDPValueBackend, seed: int) -> list[TrainSequence]:
    """Sequences with GAE returns from +-1 rewards at each sequence's last token."""
    seqs = make_sequences(seed=seed)
    rewards = []
    for k, s in enumerate(seqs):
        r = [0.0] * len(s)
        r[-1] = 1.0 if k % 2 else -1.0
        rewards.append(r)
    values = backend.forward_values(seqs, token_budget=TOKEN_BUDGET)
    discounts = [[0.95] * len(s) for s in seqs]
    return with_gae(seqs, rewards, values, algorithm_config("ppo", lam=0.9), discounts=discounts)


def step(backend: FSDPValueBackend, seqs: list[TrainSequence]) -> dict[str, float]:
    norm = float(sum(s.num_loss_tokens for s in seqs))
    return backend.train_step(
        seqs,
        make_value_loss_fn(algorithm_config("ppo", value_clip=None)),
        temperature=1.0,
        token_budget=TOKEN_BUDGET,
        global_norm=norm,
    )


def test_values_are_the_token_classifier_outputs_one_position_back(tiny_model: Path) -> None:
    backend = critic(tiny_model)
    seqs = make_sequences(seed=3)
    ours = backend.forward_values(seqs, token_budget=TOKEN_BUDGET)
    model = load_value_model(str(tiny_model)).eval()
    model.load_state_dict(backend.full_state_dict(), strict=True)
    for seq, got in zip(seqs, ours, strict=True):
        with torch.no_grad():
            out = model(input_ids=torch.tensor([seq.tokens])).logits[0, :, 0]
        expected = [0.0, *out[:-1].tolist()]  # V before token t is the output at t - 1
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), atol=1e-5, rtol=0)
    # the backbone is the policy's: only the value head is new
    state = backend.full_state_dict()
    assert {k for k in state if not k.startswith("model.")} == {"score.weight"}


def test_critic_loss_decreases_on_a_fixed_batch(tiny_model: Path) -> None:
    backend = critic(tiny_model, lr=1e-4, warmup_steps=0, schedule="constant")
    seqs = batch_with_targets(backend, seed=4)
    losses = [step(backend, seqs)["loss"] for _ in range(5)]
    assert losses[-1] < 0.5 * losses[0], losses
    assert all(b < a for a, b in itertools.pairwise(losses)), losses


def test_critic_save_and_load_resume_exactly(tiny_model: Path, tmp_path: Path) -> None:
    first = critic(tiny_model)
    seqs = batch_with_targets(first, seed=5)
    step(first, seqs)
    step(first, seqs)
    first.save(tmp_path / "critic")
    continued = step(first, seqs)

    resumed = critic(tiny_model)
    resumed.load(tmp_path / "critic")
    assert resumed.step == 2
    assert step(resumed, seqs) == continued  # loss, grad norm and lr of step 3, bit for bit
    a, b = first.full_state_dict(), resumed.full_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
