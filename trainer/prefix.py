"""Prefix-shared (tree) packing: sequences that begin with the same tokens hold them once per row.

The eight answers of a GRPO group share their prompt, so flat packing runs that prompt eight times.
A *tree* is one sequence run whole (its *trunk*) and *branches*: sequences whose first `shared`
tokens equal the trunk's and are read from the trunk's positions, so a branch adds only its own
tokens `shared..n-1` to the row, at positions `shared..n-1`. `trainer.attention` reads that layout
from the positions alone: a position that neither is 0 nor follows its predecessor starts a
branch, which attends to the first `shared` tokens of the last sequence that began at 0 (its
trunk) and to itself, causally; a branch's logits are then exactly the flat ones.

Which tokens may be shared. Position i of a row predicts the token at i + 1 (`trainer.batch`), so
a branch's tokens 1..shared are scored at its trunk's positions 0..shared-1, against the trunk's
targets. They are the branch's own only if the first `shared + 1` tokens are equal (token `shared`,
the branch's first own token, is therefore in the row twice: once in the trunk, once starting the
branch), at the same temperatures where the sequences carry them, and untrained: a branch's
trained token must be predicted at a position of its own, where its own advantage and behaviour
logprob sit. For a GRPO group that stops one token before the answer: the prompt's last token is
the one each branch repeats. Shared positions carry the trunk's training values; the branch's are
zero there (untrained), so every loss term, aggregation and statistic is the flat one.

Planning is a pure function of the sequences, so every data rank can plan every rank's rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

MIN_SHARED = 16
"""Fewest tokens worth sharing: a branch costs one attention call of its own plus a repeated
token, so a shorter common prefix is packed flat."""


class Tokens(Protocol):
    """What planning reads of a sequence (`trainer.batch.TrainSequence` has it)."""

    @property
    def tokens(self) -> list[int]: ...

    @property
    def loss_mask(self) -> list[int]: ...

    @property
    def temperatures(self) -> list[float] | None: ...


@dataclass(frozen=True, slots=True)
class Member:
    """One sequence's place in a tree."""

    seq: int
    """Index into the sequences given to `plan_trees`."""
    shared: int
    """Leading tokens read from the tree's trunk (its first member); 0 for the trunk."""


def first_trained(seq: Tokens) -> int:
    """The index of `seq`'s first trained token (its length if none is): where its prompt ends."""
    return next((t for t, m in enumerate(seq.loss_mask) if m), len(seq.tokens))


def shareable(trunk: Tokens, seq: Tokens) -> int:
    """How many leading tokens of `seq` can be read from `trunk`'s positions (module docstring):
    its first `shared + 1` tokens equal the trunk's, its tokens 1..shared untrained and, where
    both carry temperatures, sampled at the trunk's; and it keeps at least one token of its own."""
    a, b = trunk.tokens, seq.tokens
    if not a or not b or a[0] != b[0]:
        return 0
    limit = min(len(a), len(b), first_trained(seq)) - 1
    ta, tb = trunk.temperatures, seq.temperatures
    s = 0  # tokens 0..s are equal, and tokens 1..s untrained and alike in temperature
    while (
        s < limit and a[s + 1] == b[s + 1] and (ta is None or tb is None or ta[s + 1] == tb[s + 1])
    ):
        s += 1
    return s


def tree_tokens(seqs: Sequence[Tokens], tree: Sequence[Member]) -> int:
    """Row positions a tree takes: its trunk whole, and each branch less its shared tokens."""
    return sum(len(seqs[m.seq].tokens) - m.shared for m in tree)


def plan_trees(
    seqs: Sequence[Tokens], token_budget: int, *, min_shared: int = MIN_SHARED
) -> list[list[Member]]:
    """Groups `seqs` into trees of at most `token_budget` row positions (a sequence longer than
    that is a tree of its own). Sequences are taken in index order; each joins the tree (among
    those whose trunk starts with its first `min_shared` tokens and have room) from which it can
    read the most tokens, if at least `min_shared`, and otherwise starts a tree as its trunk.
    Every index appears in exactly one tree; a tree's first member is its trunk."""
    if min_shared < 1:
        raise ValueError(f"min_shared must be at least 1, got {min_shared}")
    trees: list[list[Member]] = []
    used: list[int] = []
    by_head: dict[tuple[int, ...], list[int]] = {}
    for i, seq in enumerate(seqs):
        head = tuple(seq.tokens[:min_shared])
        best, best_shared = -1, 0
        for t in by_head.get(head, ()):
            s = shareable(seqs[trees[t][0].seq], seq)
            if (
                s >= min_shared
                and s > best_shared
                and used[t] + len(seq.tokens) - s <= token_budget
            ):
                best, best_shared = t, s
        if best >= 0:
            trees[best].append(Member(i, best_shared))
            used[best] += len(seq.tokens) - best_shared
            continue
        trees.append([Member(i, 0)])
        used.append(len(seq.tokens))
        if len(seq.tokens) > min_shared:
            by_head.setdefault(head, []).append(len(trees) - 1)
    return trees


def prefix_units(
    seqs: Sequence[Tokens], n: int = 1, *, min_shared: int = MIN_SHARED
) -> list[list[int]]:
    """The sequences that share their prompt, at least `n` units of them: indices, each unit
    ascending, in order of first member. A sequence's prompt is its tokens before its first
    trained one; sequences whose prompts (of more than `min_shared` tokens) are equal are one
    unit (a GRPO group's answers; a multi-turn group's episodes, by their first prompt), any other
    sequence a unit of its own. A common head alone (a chat template's system prompt) joins
    nothing. While there are fewer than `n` units, the largest (first of the largest) is halved,
    so PPO keeps its `ppo_n_minibatches` optimizer steps on a batch of few groups. Mini-batches
    split by these units keep every group's tree whole (`AlgorithmConfig.ppo_minibatch_split`)."""
    units: dict[tuple[int, ...], list[int]] = {}
    for i, seq in enumerate(seqs):
        prompt = tuple(seq.tokens[: first_trained(seq)])
        units.setdefault(prompt if len(prompt) > min_shared else (-1 - i,), []).append(i)
    out = list(units.values())
    while len(out) < n and any(len(u) > 1 for u in out):
        k = max(range(len(out)), key=lambda j: (len(out[j]), -j))
        half = (len(out[k]) + 1) // 2
        out[k : k + 1] = [out[k][:half], out[k][half:]]
    return out


def minibatch_units(
    seqs: Sequence[Tokens], split: str, n: int, *, trees: bool
) -> list[list[int]] | None:
    """What PPO's `n` mini-batches place whole under `AlgorithmConfig.ppo_minibatch_split`
    (`split`; `trees`: the backend packs prefix-shared trees, which `auto` follows): the
    `prefix_units`, or None for each sequence alone."""
    if split == "prefixes" or (split == "auto" and trees):
        return prefix_units(seqs, n)
    return None
