"""Which weights a policy version number names, and how many training steps lie between two.

Version numbers only grow, but a trainer that resumes from a checkpoint may find the engines
serving a newer version (steps after the checkpoint were published, then lost with the
trainer). It republishes the checkpoint's weights under a new number, `served + 1`, that is an
*alias* of the checkpoint's version: the same weights, zero steps apart. Every other version v
is one optimizer step after v - 1. So the versions form a tree: each has a parent (v - 1, one
step; or for an alias, the version it repeats, no step), and the versions between a checkpoint
and its alias are a lost branch.

A token's staleness is the number of steps between the weights that sampled it and the current
weights along that tree (`Lineage.age`): for a token of the lost branch, its steps away from
the checkpoint plus the steps since. A plain difference of numbers would count the alias's jump
as steps and drop every requeued trajectory as stale (the reason this exists).

The lineage is kept in `checkpoint_dir/lineage.json`: the version of the run's initial weights
(`start`, what the engines served when its first trainer started) and the aliases. It is
written whenever an alias is made, before it is published, so a crash cannot lose it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

FILE = "lineage.json"


@dataclass(slots=True)
class Lineage:
    start: int = 0
    """The version of the run's initial weights (its first trainer's starting point)."""
    aliases: dict[int, int] = field(default_factory=dict)
    """Published version -> the version whose weights it republished (zero steps apart)."""

    def parent(self, version: int) -> tuple[int, int] | None:
        """(parent version, steps to it), or None at the root (the start, or version 0)."""
        if version in self.aliases:
            return self.aliases[version], 0
        if version <= self.start:
            return None
        return version - 1, 1

    def age(self, version: int, current: int) -> int:
        """Training steps between the weights of `version` and those of `current` along the
        tree (module docstring). A version below the start counts its plain difference."""
        if version == current:
            return 0
        up: dict[int, int] = {}
        node: int | None = current
        depth = 0
        while node is not None:
            up[node] = depth
            step = self.parent(node)
            if step is None:
                break
            node, d = step
            depth += d
        node, depth = version, 0
        while node not in up:
            step = self.parent(node)
            if step is None:  # at or below the start: a plain difference from it
                return (
                    depth + up[self.start] + abs(self.start - node)
                    if self.start in up
                    else (depth + abs(current - node))
                )
            node, d = step
            depth += d
        return depth + up[node]

    def alias(self, published: int, of: int) -> None:
        """Record that version `published` republishes the weights of version `of`."""
        if published <= of:
            raise ValueError(f"an alias is a newer number: {published} cannot repeat {of}")
        self.aliases[published] = of


def load(root: Path) -> Lineage | None:
    """The lineage kept under checkpoint dir `root`, or None when there is none yet."""
    path = root / FILE
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    return Lineage(int(data["start"]), {int(k): int(v) for k, v in data["aliases"].items()})


def save(root: Path, lineage: Lineage) -> None:
    """Write the lineage atomically (a temporary file renamed over it)."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / (FILE + ".tmp")
    tmp.write_text(
        json.dumps(
            {"start": lineage.start, "aliases": {str(k): v for k, v in lineage.aliases.items()}}
        )
    )
    os.replace(tmp, root / FILE)
