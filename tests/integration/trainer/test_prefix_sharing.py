"""`backend.prefix_sharing` on the FSDP backend: a GRPO batch packed as prefix-shared trees trains
the weights that flat packing trains (the decoupled PPO loss with an entropy term, per-token
temperatures, a critic), one process and two, in fewer row positions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.torchrun import max_abs_diff, torchrun
from tests.support.workers import prefix_worker
from tests.support.workers.fsdp_worker import build_backend
from tests.support.workers.prefix_worker import TOKEN_BUDGET, group_sequences, train
from trainer.algorithms.config import algorithm_config
from trainer.batch import plan_rows
from trainer.loss import make_value_loss_fn

pytestmark = pytest.mark.slow

PARAM_ATOL = 1e-5


@pytest.fixture(scope="module")
def runs(tiny_model: Path) -> dict[bool, dict[str, Any]]:
    """The same two decoupled-PPO steps, flat and prefix-shared, in this process."""
    out = {}
    for sharing in (False, True):
        backend = build_backend(tiny_model, prefix_sharing=sharing)
        out[sharing] = train(backend, group_sequences()) | {"backend": backend}
    return out


def test_trees_train_the_weights_flat_packing_trains(runs: dict[bool, dict[str, Any]]) -> None:
    flat, tree = runs[False], runs[True]
    diff = max_abs_diff(flat["state"], tree["state"])
    print(f"max |param(flat) - param(prefix-shared)| after 2 steps: {diff:.3g}")
    assert diff <= PARAM_ATOL
    assert max_abs_diff(flat["state"], flat["initial"]) > 1e-4  # it trained
    for a, b in zip(flat["stats"], tree["stats"], strict=True):
        assert b == pytest.approx(a, rel=1e-5, abs=1e-7)
    for a, b in zip(flat["logprobs"], tree["logprobs"], strict=True):
        torch.testing.assert_close(torch.tensor(b), torch.tensor(a), atol=1e-5, rtol=0)


def test_trees_hold_each_prompt_once_per_row() -> None:
    seqs = group_sequences()
    flat = plan_rows(seqs, TOKEN_BUDGET)
    tree = plan_rows(seqs, TOKEN_BUDGET, prefix_sharing=True)
    positions = [sum(len(seqs[m.seq]) - m.shared for m in row) for row in tree]
    assert sum(positions) < 0.5 * sum(len(s) for s in seqs)
    assert len(tree) < len(flat)
    assert max(positions) <= TOKEN_BUDGET


def test_the_backend_runs_each_prompt_once(runs: dict[bool, dict[str, Any]]) -> None:
    """What the model itself is run on: the positions its embedding sees in a forward of the
    group, flat and as trees (the planner's saving is the backend's)."""
    seqs = group_sequences()
    seen = {}
    for sharing in (False, True):
        backend = runs[sharing]["backend"]
        counts: list[int] = []
        embed = backend.model.get_input_embeddings()
        hook = embed.register_forward_hook(
            lambda _m, args, _o, counts=counts: counts.append(args[0].numel())
        )
        try:
            backend.forward_logprobs(seqs, 1.0, token_budget=TOKEN_BUDGET)
        finally:
            hook.remove()
        seen[sharing] = sum(counts)
    assert seen[False] == sum(len(s) for s in seqs)
    assert seen[True] < 0.5 * seen[False]


def test_two_processes_train_the_weights_of_one(
    runs: dict[bool, dict[str, Any]], tiny_model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "two.pt"
    torchrun(prefix_worker.__file__, [str(tiny_model), str(out)])
    two = torch.load(out)
    assert two["world_size"] == 2
    assert max_abs_diff(runs[True]["state"], two["state"]) <= PARAM_ATOL
    for a, b in zip(runs[True]["stats"], two["stats"], strict=True):
        assert b == pytest.approx(a, rel=1e-5, abs=1e-7)


def test_a_critic_on_trees_learns_the_flat_values(tiny_model: Path) -> None:
    seqs = group_sequences(returns=True)
    loss_fn = make_value_loss_fn(algorithm_config("ppo", value_clip=None))
    values = {}
    for sharing in (False, True):
        critic = build_backend(tiny_model, value=True, prefix_sharing=sharing)
        norm = float(sum(s.num_loss_tokens for s in seqs))
        stats = critic.train_step(
            seqs, loss_fn, temperature=1.0, token_budget=TOKEN_BUDGET, global_norm=norm
        )
        values[sharing] = (stats, critic.forward_values(seqs, token_budget=TOKEN_BUDGET))
    assert values[True][0] == pytest.approx(values[False][0], rel=1e-5, abs=1e-7)
    for a, b in zip(values[False][1], values[True][1], strict=True):
        torch.testing.assert_close(torch.tensor(b), torch.tensor(a), atol=1e-5, rtol=0)
