"""Staleness counts training steps between weights, along the tree that republishing makes."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer import lineage
from trainer.lineage import Lineage


def test_without_aliases_the_age_is_the_difference() -> None:
    tree = Lineage()
    assert [tree.age(v, 5) for v in range(6)] == [5, 4, 3, 2, 1, 0]


def test_a_republished_checkpoint_is_zero_steps_from_its_alias() -> None:
    """Checkpoint at version 3; the engines served 5 (versions 4, 5 lost); the checkpoint's
    weights went out again as version 6. A trajectory sampled at 3 is fresh at 6 (it was judged
    3 versions stale, and dropped under eta 1, before)."""
    tree = Lineage(aliases={6: 3})
    assert tree.age(3, 6) == 0
    assert tree.age(2, 6) == 1
    assert tree.age(3, 7) == 1
    assert tree.age(6, 7) == 1
    # the lost branch: its steps from the checkpoint, plus ours since
    assert tree.age(4, 6) == 1
    assert tree.age(5, 6) == 2
    assert tree.age(5, 7) == 3


def test_aliases_chain_across_restarts() -> None:
    tree = Lineage(aliases={6: 3, 10: 7})  # 3 -> 6, one step to 7, lost 8 and 9, 7 -> 10
    assert tree.age(8, 11) == 2
    assert tree.age(4, 11) == 3
    assert tree.age(7, 11) == 1
    assert tree.age(2, 11) == 3


def test_versions_before_the_start_count_their_plain_difference() -> None:
    """A run that started from weights the engines served as version 5 (an exported policy)."""
    tree = Lineage(start=5)
    assert tree.age(5, 6) == 1
    assert tree.age(6, 6) == 0
    assert tree.age(3, 6) == 3


def test_it_survives_on_disk(tmp_path: Path) -> None:
    assert lineage.load(tmp_path) is None
    lineage.save(tmp_path, Lineage(start=2, aliases={9: 4}))
    assert lineage.load(tmp_path) == Lineage(start=2, aliases={9: 4})


def test_an_alias_is_a_newer_number() -> None:
    with pytest.raises(ValueError, match="newer number"):
        Lineage().alias(3, 3)
