"""Prefix-shared (tree) packing: what may be shared, the trees planned under a budget, and tree
rows whose logprobs, entropies and gradients are the flat rows' (the varlen kernel)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoModelForCausalLM

from trainer.attention import register as register_varlen
from trainer.attention import tree_segments
from trainer.backends.config import FSDPSpec
from trainer.batch import (
    MicroBatch,
    TrainSequence,
    pack,
    plan_rows,
    token_entropy,
    token_logprobs,
    tree_shards,
    unpack_token_values,
)
from trainer.config import TrainConfig
from trainer.prefix import MIN_SHARED, Member, minibatch_units, plan_trees, prefix_units, shareable

ATOL = 1e-5


def seq(
    tokens: list[int], prompt: int, *, temps: list[float] | None = None, seed: int = 0
) -> TrainSequence:
    """Untrained prompt, then trained tokens whose values differ per sequence and token."""
    rng = random.Random(seed)
    mask = [0] * prompt + [1] * (len(tokens) - prompt)
    return TrainSequence(
        tokens=tokens,
        loss_mask=mask,
        behav_logprobs=[-rng.uniform(0.5, 4.0) * m for m in mask],
        advantages=[rng.choice((-1.0, 0.5, 1.5)) * m for m in mask],
        versions=[3 if m else -1 for m in mask],
        prox_logprobs=[-rng.uniform(0.5, 4.0) * m for m in mask],
        temperatures=temps,
    )


def groups(
    n_groups: int, size: int, prompt: int, answer: tuple[int, int], seed: int = 0
) -> list[TrainSequence]:
    """GRPO-like groups: `size` answers of random lengths to each group's random prompt, the
    groups interleaved (as a batch arrives)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(256) for _ in range(prompt)] for _ in range(n_groups)]
    out = []
    for _k in range(size):
        for g in range(n_groups):
            tokens = prompts[g] + [rng.randrange(256) for _ in range(rng.randint(*answer))]
            out.append(seq(tokens, prompt, seed=rng.randrange(10**6)))
    return out


def test_what_may_be_shared() -> None:
    base = list(range(1, 31))
    trunk = seq(base, 20)
    assert shareable(trunk, seq(base[:20] + [99] * 10, 20)) == 19  # up to the prompt's last
    assert shareable(trunk, seq(base, 20)) == 19  # a duplicate shares no trained token
    assert shareable(trunk, seq(base[:12] + [99] * 18, 20)) == 11  # the tokens differ at 12
    assert shareable(trunk, seq(base, 5)) == 4  # its own tokens 5.. are trained
    assert shareable(trunk, seq([0, *base[1:]], 20)) == 0  # the first token differs
    assert shareable(trunk, seq(base[:8], 8)) == 7  # it keeps one token of its own
    # temperatures: shared tokens must have been scored at the trunk's
    ones, other = [1.0] * 30, [1.0] * 10 + [0.5] * 20
    assert shareable(seq(base, 20, temps=ones), seq(base, 20, temps=other)) == 9
    assert shareable(seq(base, 20, temps=ones), seq(base, 20)) == 19


@pytest.mark.parametrize("seed", range(4))
def test_trees_keep_every_sequence_once_within_the_budget(seed: int) -> None:
    seqs = groups(3, 8, 40, (1, 30), seed=seed)
    rng = random.Random(seed)
    seqs += [seq([rng.randrange(256) for _ in range(n)], 2) for n in (5, 70, 33)]
    budget = 160
    trees = plan_trees(seqs, budget)
    assert sorted(m.seq for t in trees for m in t) == list(range(len(seqs)))
    for t in trees:
        assert t[0].shared == 0
        assert all(m.shared >= 16 for m in t[1:])
        positions = sum(len(seqs[m.seq]) - m.shared for m in t)
        assert positions <= budget or len(t) == 1
        assert {tuple(seqs[m.seq].tokens[:40]) for m in t} == {tuple(seqs[t[0].seq].tokens[:40])}
    # every group's answers share its prompt; the three loners stay alone
    assert sum(1 for t in trees if len(t) > 1) >= 3
    assert sum(1 for t in trees for m in t if m.shared == 39) >= 3 * 8 - len(trees)
    rows = plan_rows(seqs, budget, prefix_sharing=True)
    flat = plan_rows(seqs, budget)
    assert sorted(m.seq for r in rows for m in r) == list(range(len(seqs)))
    assert len(rows) < len(flat)


def test_a_tree_row_reads_as_trunks_and_branches() -> None:
    assert tree_segments(torch.tensor([0, 1, 2, 3, 4, 2, 3, 4, 0, 1, 1, 2])) == [
        (0, 5, 0, 0),
        (5, 8, 0, 2),
        (8, 10, 8, 0),
        (10, 12, 8, 1),
    ]
    assert tree_segments(torch.tensor([0, 1, 2, 0, 1])) == [(0, 3, 0, 0), (3, 5, 3, 0)]
    with pytest.raises(ValueError, match="past its trunk"):
        tree_segments(torch.tensor([0, 1, 5, 6]))


def test_tree_rows_carry_each_sequences_values_where_flat_rows_do() -> None:
    seqs = groups(2, 4, 20, (2, 9), seed=1)
    (flat,) = pack(seqs, 10_000)
    (tree,) = pack(seqs, 10_000, prefix_sharing=True)
    assert tree.num_tokens == flat.num_tokens - 6 * 19  # two trunks, six branches of 19 shared
    assert tree.input_ids_1T.shape[1] == tree.num_tokens
    for mb in (flat, tree):  # a row of each position's own index, unpacked
        mb_values = torch.arange(mb.num_tokens, dtype=torch.float32)[None]
        assert len(unpack_token_values(mb_values, mb)) == len(seqs)

    def per_token(mb: MicroBatch, row: torch.Tensor) -> dict[int, list[float]]:
        return dict(zip(mb.seq_ids, unpack_token_values(row, mb), strict=True))

    for name in ("loss_mask_1T", "behav_logp_1T", "advantages_1T", "prox_logp_1T", "targets_1T"):
        a = per_token(flat, getattr(flat, name).float())
        b = per_token(tree, getattr(tree, name).float())
        assert a == b, name
    assert tree.num_loss_tokens == flat.num_loss_tokens
    assert sorted(tree.seq_shared) == [0, 0] + [19] * 6


def test_tree_shards_keep_a_groups_sequences_on_one_rank() -> None:
    seqs = groups(4, 8, 30, (1, 20), seed=2)
    shards = tree_shards(seqs, 2, 10_000)
    assert sorted(i for s in shards for i in s) == list(range(len(seqs)))
    for shard in shards:
        prompts = {tuple(seqs[i].tokens[:30]) for i in shard}
        assert len(prompts) == 2  # two whole groups each
        assert len(shard) == 16


@pytest.fixture(scope="module")
def varlen_model(tiny_model: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(
        str(tiny_model), dtype=torch.float32, attn_implementation=register_varlen()
    )


def _row_loss(model: Any, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprobs and entropies of a row (temperature per position) and a loss that uses both."""
    logits = model(
        input_ids=mb.input_ids_1T, position_ids=mb.position_ids_1T, use_cache=False
    ).logits
    temp = mb.temperature_1T if mb.temperature_1T is not None else 0.8
    logp = token_logprobs(logits, mb.targets_1T, temp)
    entropy = token_entropy(logits, temp)
    mask = mb.loss_mask_1T
    loss = -(logp * mb.advantages_1T * mask).sum() - 0.1 * (entropy * mask).sum()
    return logp, entropy, loss


@pytest.mark.parametrize("temperatures", [False, True])
def test_tree_rows_give_the_flat_logprobs_entropies_and_gradients(
    varlen_model: Any, temperatures: bool
) -> None:
    seqs = groups(3, 5, 24, (1, 12), seed=3)
    seqs.append(seq(seqs[0].tokens, 24, seed=9))  # a duplicate of a branch
    if temperatures:
        seqs = [
            TrainSequence(
                **{
                    **{f: getattr(s, f) for f in s.__slots__},
                    "temperatures": [0.7 if t % 3 else 1.0 for t in range(len(s))],
                }
            )
            for s in seqs
        ]
    results = {}
    for sharing in (False, True):
        varlen_model.zero_grad(set_to_none=True)
        micro = pack(seqs, 90, prefix_sharing=sharing)
        assert len(micro) > 1
        logps: dict[int, list[float]] = {}
        entropies: dict[int, list[float]] = {}
        for mb in micro:
            logp, entropy, loss = _row_loss(varlen_model, mb)
            loss.backward()
            logps |= dict(zip(mb.seq_ids, unpack_token_values(logp.detach(), mb), strict=True))
            entropies |= dict(
                zip(mb.seq_ids, unpack_token_values(entropy.detach(), mb), strict=True)
            )
        grads = {n: p.grad.clone() for n, p in varlen_model.named_parameters()}
        results[sharing] = (logps, entropies, grads, sum(mb.num_tokens for mb in micro))
    flat, tree = results[False], results[True]
    assert tree[3] < flat[3] * 0.6  # the shared prompts are in the rows once
    for i in range(len(seqs)):
        torch.testing.assert_close(
            torch.tensor(tree[0][i]), torch.tensor(flat[0][i]), atol=ATOL, rtol=0
        )
        torch.testing.assert_close(
            torch.tensor(tree[1][i]), torch.tensor(flat[1][i]), atol=ATOL, rtol=0
        )
    for name, g in flat[2].items():
        torch.testing.assert_close(tree[2][name], g, atol=ATOL, rtol=1e-4, msg=name)


def test_members_of_a_flat_plan_share_nothing() -> None:
    seqs = groups(1, 3, 20, (1, 5))
    (row,) = plan_rows(seqs, 10_000)
    assert sorted(row, key=lambda m: m.seq) == [Member(i, 0) for i in (0, 1, 2)]
    (mb,) = pack(seqs, 10_000)
    assert mb.seq_shared == ()
    assert mb.seq_trunk == ()


def test_what_cannot_pack_trees_refuses_the_option() -> None:
    def backend(section: Any) -> None:
        TrainConfig.model_validate({"backend": section})

    backend({"type": "fsdp", "prefix_sharing": True})
    backend({"type": "megatron", "prefix_sharing": False})
    cases = {
        "varlen attention": {"type": "fsdp", "prefix_sharing": True, "attention": "sdpa"},
        "context parallel": {"allocation": "fsdp:c2", "prefix_sharing": True},
        "router's balance loss": {"type": "archon", "prefix_sharing": True},
        "block-diagonal mask": {"type": "megatron", "prefix_sharing": True},
    }
    for reason, section in cases.items():
        with pytest.raises(ValidationError, match=reason):
            backend(section)
    assert FSDPSpec().prefix_sharing is False
    # the run config's setting reaches the backend's constructor
    config = TrainConfig.model_validate({"backend": {"prefix_sharing": True}})
    assert config.backend_config("m").prefix_sharing is True


def test_prefix_units_are_the_groups_and_auto_follows_the_backend() -> None:
    seqs = groups(3, 4, 20, (1, 9), seed=3)  # interleaved: sequence i is of group i % 3
    units = [[g + 3 * k for k in range(4)] for g in range(3)]
    assert prefix_units(seqs) == units
    short = groups(3, 4, MIN_SHARED, (1, 9), seed=3)  # prompts too short to share
    assert prefix_units(short) == [[i] for i in range(12)]
    # a chat template's system prompt before each group's question joins no groups
    system = list(range(100, 140))
    chat = [seq(system + s.tokens, len(system) + 20, seed=i) for i, s in enumerate(seqs)]
    assert prefix_units(chat) == units
    assert minibatch_units(seqs, "prefixes", 3, trees=False) == units
    assert minibatch_units(seqs, "auto", 3, trees=True) == units
    assert minibatch_units(seqs, "auto", 3, trees=False) is None
    assert minibatch_units(seqs, "sequences", 3, trees=True) is None


def test_few_groups_are_halved_into_as_many_units_as_mini_batches() -> None:
    seqs = groups(2, 4, 20, (1, 9), seed=4)  # groups [0, 2, 4, 6] and [1, 3, 5, 7]
    assert prefix_units(seqs, 2) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert prefix_units(seqs, 3) == [[0, 2], [4, 6], [1, 3, 5, 7]]
    assert prefix_units(seqs, 4) == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert len(prefix_units(seqs, 20)) == 8  # at most one a sequence
