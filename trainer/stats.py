"""Merging the stats of several parts of one update into one row: the micro-batches of an
optimizer step (`FSDPBackend.train_step`) and the optimizer steps of a training step
(`Trainer._optimize`). One rule for both, so a stat means the same at every level.

Each part is `(weight, stats)`, the weight its trained tokens. A `*_min` stat is the minimum and a
`*_max` stat the maximum over the parts that trained a token (over all parts where none did);
the keys in `summed` are summed, those in `averaged` averaged plainly, those in `first` taken from
the first part that has them; every other stat is the weighted mean (plain where no part that has
it trained a token).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence


def merge_stats(
    parts: Sequence[tuple[float, Mapping[str, float]]],
    *,
    summed: Collection[str] = (),
    averaged: Collection[str] = (),
    first: Collection[str] = (),
) -> dict[str, float]:
    merged: dict[str, float] = {}
    keys = {k for _, stats in parts for k in stats}
    for key in sorted(keys):
        pairs = [(w, stats[key]) for w, stats in parts if key in stats]
        weighted = [(w, v) for w, v in pairs if w] or pairs
        total = sum(w for w, _ in pairs)
        if key in summed:
            merged[key] = sum(v for _, v in pairs)
        elif key in averaged:
            merged[key] = sum(v for _, v in pairs) / len(pairs)
        elif key in first:
            merged[key] = pairs[0][1]
        elif key.endswith("_min"):
            merged[key] = min(v for _, v in weighted)
        elif key.endswith("_max"):
            merged[key] = max(v for _, v in weighted)
        elif total:
            merged[key] = sum(w * v for w, v in pairs) / total
        else:
            merged[key] = sum(v for _, v in pairs) / len(pairs)
    return merged
