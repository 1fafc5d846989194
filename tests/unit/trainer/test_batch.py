"""Packing into token-budget micro-batches, the shifted alignment, packed forwards that equal
separate ones, and `token_logprobs` against `F.cross_entropy`."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from trainer.attention import VARLEN, tree_segments
from trainer.attention import register as register_varlen
from trainer.batch import (
    TrainSequence,
    pack,
    plan_micro_batches,
    split_minibatches,
    token_logprobs,
    unpack_token_values,
)


def make_seq(tokens: list[int], prompt: int, *, ref: bool = False) -> TrainSequence:
    """A sequence whose values encode their own token index, so misalignment is visible."""
    n = len(tokens)
    mask = [0] * prompt + [1] * (n - prompt)
    return TrainSequence(
        tokens=tokens,
        loss_mask=mask,
        behav_logprobs=[-(t + 0.5) * m for t, m in enumerate(mask)],
        advantages=[(t + 0.25) * m for t, m in enumerate(mask)],
        versions=[t if m else -1 for t, m in enumerate(mask)],
        ref_logprobs=[-(t + 0.75) * m for t, m in enumerate(mask)] if ref else None,
    )


def random_seqs(lengths: list[int], seed: int = 0) -> list[TrainSequence]:
    rng = random.Random(seed)
    return [make_seq([rng.randrange(256) for _ in range(n)], max(1, n // 2)) for n in lengths]


@pytest.mark.parametrize("seed", range(5))
def test_plan_respects_budget_and_keeps_every_sequence_once(seed: int) -> None:
    rng = random.Random(seed)
    budget = 64
    lengths = [rng.randint(1, 90) for _ in range(40)]
    bins = plan_micro_batches(lengths, budget)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    for b in bins:
        total = sum(lengths[i] for i in b)
        assert total <= budget or len(b) == 1
    # First fit: no later bin's first sequence would have fit into an earlier bin.
    for k, b in enumerate(bins):
        head = lengths[b[0]]
        for earlier in bins[:k]:
            assert sum(lengths[i] for i in earlier) + head > budget


def test_plan_is_first_fit_decreasing() -> None:
    assert plan_micro_batches([3, 9, 5, 12, 4, 2], 10) == [[3], [1], [2, 4], [0, 5]]
    assert plan_micro_batches([], 10) == []
    with pytest.raises(ValueError, match="token_budget"):
        plan_micro_batches([1], 0)


def test_minibatches_mix_anew_each_epoch_and_repeat_under_the_same_seed() -> None:
    rng = random.Random(0)
    lengths = [rng.randint(1, 90) for _ in range(32)]
    epochs = [split_minibatches(lengths, 4, seed=f"0:7:{e}") for e in range(3)]
    for split in epochs:
        assert sorted(i for g in split for i in g) == list(range(len(lengths)))
        assert all(g == sorted(g) for g in split)
        loads = [sum(lengths[i] for i in g) for g in split]
        assert max(loads) - min(loads) <= max(lengths)  # balanced by tokens
    compositions = [{frozenset(g) for g in split} for split in epochs]
    assert compositions[0] != compositions[1] != compositions[2] != compositions[0]
    assert epochs == [split_minibatches(lengths, 4, seed=f"0:7:{e}") for e in range(3)]
    assert split_minibatches(lengths, 4, seed="0:8:0") != epochs[0]  # the next step: anew too


def test_minibatches_are_at_most_the_sequences() -> None:
    assert split_minibatches([3, 5], 4, seed="s") in ([[0], [1]], [[1], [0]])
    assert split_minibatches([3, 5, 2], 1, seed="s") == [[0, 1, 2]]
    with pytest.raises(ValueError, match="n must be positive"):
        split_minibatches([1], 0, seed="s")


def test_minibatch_units_go_whole_and_each_alone_is_the_plain_split() -> None:
    rng = random.Random(1)
    lengths = [rng.randint(1, 90) for _ in range(32)]
    units = [list(range(g, g + 8)) for g in range(0, 32, 8)]
    for e in range(3):
        split = split_minibatches(lengths, 4, seed=f"0:7:{e}", units=units)
        assert sorted(sorted(g) for g in split) == units  # each mini-batch one whole unit
        alone = [[i] for i in range(32)]
        plain = split_minibatches(lengths, 4, seed=f"0:7:{e}")
        assert split_minibatches(lengths, 4, seed=f"0:7:{e}", units=alone) == plain
    two = split_minibatches(lengths, 2, seed="s", units=units)
    assert sorted(len(g) for g in two) == [16, 16]
    assert all(set(u) <= set(g) or not set(u) & set(g) for g in two for u in units)
    assert len(split_minibatches(lengths, 8, seed="s", units=units)) == 4  # at most the units
    with pytest.raises(ValueError, match="partition"):
        split_minibatches([1, 2, 3], 2, seed="s", units=[[0, 1], [1, 2]])
    with pytest.raises(ValueError, match="partition"):
        split_minibatches([1, 2, 3], 2, seed="s", units=[[0, 1]])


def test_pack_keeps_every_token_once_with_no_padding() -> None:
    seqs = random_seqs([5, 17, 1, 30, 8, 12, 3], seed=1)
    micro = pack(seqs, 20)
    assert sorted(i for mb in micro for i in mb.seq_ids) == list(range(len(seqs)))
    for mb in micro:
        assert mb.input_ids_1T.shape == (1, mb.num_tokens)
        assert mb.num_tokens <= 20 or len(mb.seq_lens) == 1
        row = mb.input_ids_1T[0].tolist()
        start = 0
        for i, n in zip(mb.seq_ids, mb.seq_lens, strict=True):
            assert row[start : start + n] == seqs[i].tokens
            start += n
    assert sum(mb.num_tokens for mb in micro) == sum(len(s) for s in seqs)


def test_shifted_alignment() -> None:
    a = make_seq([10, 11, 12, 13], prompt=2, ref=True)
    b = make_seq([20, 21, 22], prompt=1, ref=True)
    c = make_seq([30], prompt=1, ref=True)
    (mb,) = pack([a, b, c], 100)
    assert mb.seq_ids == (0, 1, 2)
    assert mb.seq_lens == (4, 3, 1)
    assert mb.input_ids_1T.tolist() == [[10, 11, 12, 13, 20, 21, 22, 30]]
    assert mb.position_ids_1T.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0]]
    assert mb.seq_index_1T.tolist() == [[0, 0, 0, 0, 1, 1, 1, 2]]
    # Position i holds the next token of its sequence and that token's values; last is empty.
    assert mb.targets_1T.tolist() == [[11, 12, 13, 0, 21, 22, 0, 0]]
    assert mb.loss_mask_1T.tolist() == [[False, True, True, False, True, True, False, False]]
    assert mb.versions_1T.tolist() == [[-1, 2, 3, -1, 1, 2, -1, -1]]
    assert mb.behav_logp_1T.tolist() == [[0, -2.5, -3.5, 0, -1.5, -2.5, 0, 0]]
    assert mb.advantages_1T.tolist() == [[0, 2.25, 3.25, 0, 1.25, 2.25, 0, 0]]
    assert mb.ref_logp_1T is not None
    assert mb.ref_logp_1T.tolist() == [[0, -2.75, -3.75, 0, -1.75, -2.75, 0, 0]]
    assert mb.prox_logp_1T is None
    assert mb.num_loss_tokens == a.num_loss_tokens + b.num_loss_tokens + c.num_loss_tokens
    # unpack_token_values inverts the shift: entry t is token t's value, entry 0 is 0.
    assert unpack_token_values(mb.behav_logp_1T, mb) == [a.behav_logprobs, b.behav_logprobs, [0.0]]


def test_train_sequence_invariants() -> None:
    with pytest.raises(ValueError, match="advantages has 2 entries"):
        TrainSequence(
            tokens=[1, 2, 3],
            loss_mask=[0, 1, 1],
            behav_logprobs=[0, 0, 0],
            advantages=[0, 0],
            versions=[-1, 0, 0],
        )
    with pytest.raises(ValueError, match=r"loss_mask\[0\]"):
        TrainSequence(
            tokens=[1, 2],
            loss_mask=[1, 1],
            behav_logprobs=[0, 0],
            advantages=[0, 0],
            versions=[0, 0],
        )
    with pytest.raises(ValueError, match="at least one token"):
        TrainSequence(tokens=[], loss_mask=[], behav_logprobs=[], advantages=[], versions=[])


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_token_logprobs_matches_cross_entropy(temperature: float) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 37, 50, generator=gen, dtype=torch.float64) * 3
    targets = torch.randint(0, 50, (1, 37), generator=gen)
    weights = torch.randn(1, 37, generator=gen, dtype=torch.float64)

    ours = logits.clone().requires_grad_(True)
    logp = token_logprobs(ours, targets, temperature, chunk=8)  # several chunks, a ragged last
    ref = logits.clone().requires_grad_(True)
    ref_logp = -F.cross_entropy(ref[0] / temperature, targets[0], reduction="none")

    assert logp.dtype == torch.float64
    torch.testing.assert_close(logp[0], ref_logp, atol=1e-12, rtol=0)
    (logp[0] * weights[0]).sum().backward()
    (ref_logp * weights[0]).sum().backward()
    assert ours.grad is not None
    assert ref.grad is not None
    torch.testing.assert_close(ours.grad, ref.grad, atol=1e-12, rtol=0)


def test_token_logprobs_of_bf16_logits_is_float32() -> None:
    logits = torch.randn(1, 5, 11).bfloat16().requires_grad_(True)
    logp = token_logprobs(logits, torch.zeros(1, 5, dtype=torch.int64))
    assert logp.dtype == torch.float32
    expected = torch.log_softmax(logits.detach().float(), -1)[..., 0]
    torch.testing.assert_close(logp.detach(), expected)
    logp.sum().backward()
    assert logits.grad is not None
    assert logits.grad.dtype == torch.bfloat16


@pytest.fixture(scope="module", params=["sdpa", "eager", "varlen"])
def hf_model(request: pytest.FixtureRequest, tiny_model: Path) -> Any:
    attn = register_varlen() if request.param == "varlen" else request.param
    return AutoModelForCausalLM.from_pretrained(
        str(tiny_model), dtype=torch.float32, attn_implementation=attn
    ).eval()


def test_packed_forward_equals_separate_forwards(hf_model: Any) -> None:
    seqs = random_seqs([9, 1, 23, 4, 15, 2, 30, 7], seed=3)
    micro = pack(seqs, 40)
    assert any(len(mb.seq_lens) >= 3 for mb in micro)
    temperature = 0.8
    packed: dict[int, list[float]] = {}
    with torch.no_grad():
        for mb in micro:
            logits = hf_model(
                input_ids=mb.input_ids_1T, position_ids=mb.position_ids_1T, use_cache=False
            ).logits
            logp = token_logprobs(logits, mb.targets_1T, temperature)
            packed |= dict(zip(mb.seq_ids, unpack_token_values(logp, mb), strict=True))
        for i, s in enumerate(seqs):
            ids = torch.tensor([s.tokens])
            logits = hf_model(input_ids=ids, use_cache=False).logits[0, :-1]
            alone = torch.log_softmax(logits / temperature, -1).gather(-1, ids[0, 1:, None])
            expected = [0.0, *alone[:, 0].tolist()]
            torch.testing.assert_close(
                torch.tensor(packed[i]), torch.tensor(expected), atol=1e-5, rtol=0
            )


def test_a_flat_row_splits_at_its_position_resets() -> None:
    def bounds(positions: list[int]) -> list[tuple[int, int]]:
        return [(a, b) for a, b, _, _ in tree_segments(torch.tensor(positions, dtype=torch.int64))]

    assert bounds([0, 1, 2, 0, 1, 0, 0, 1, 2, 3]) == [(0, 3), (3, 5), (5, 6), (6, 10)]
    assert bounds([0, 1, 2]) == [(0, 3)]
    assert bounds([]) == []


def test_varlen_packed_gradients_equal_separate_sdpa_forwards(tiny_model: Path) -> None:
    """The per-sequence kernel is exact in both passes: a packed varlen forward/backward gives the
    gradients of separate (unpacked) sdpa forwards."""
    seqs = random_seqs([19, 3, 27, 1, 11], seed=5)
    (mb,) = pack(seqs, 100)
    weights = torch.randn(mb.targets_1T.shape, generator=torch.Generator().manual_seed(2))
    varlen = AutoModelForCausalLM.from_pretrained(
        str(tiny_model), dtype=torch.float32, attn_implementation=register_varlen()
    )
    assert varlen.config._attn_implementation == VARLEN
    logits = varlen(
        input_ids=mb.input_ids_1T, position_ids=mb.position_ids_1T, use_cache=False
    ).logits
    (token_logprobs(logits, mb.targets_1T) * weights * mb.loss_mask_1T).sum().backward()

    sdpa = AutoModelForCausalLM.from_pretrained(
        str(tiny_model), dtype=torch.float32, attn_implementation="sdpa"
    )
    start = 0
    for n in mb.seq_lens:  # each sequence alone, its slice of the same weighted loss
        sl = slice(start, start + n)
        logits = sdpa(input_ids=mb.input_ids_1T[:, sl], use_cache=False).logits
        logp = token_logprobs(logits, mb.targets_1T[:, sl])
        (logp * weights[:, sl] * mb.loss_mask_1T[:, sl]).sum().backward()
        start += n
    grads = dict(sdpa.named_parameters())
    for name, p in varlen.named_parameters():
        other = grads[name].grad
        assert p.grad is not None, name
        assert other is not None, name
        torch.testing.assert_close(p.grad, other, atol=1e-5, rtol=1e-4)
