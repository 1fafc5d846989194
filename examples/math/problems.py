"""Arithmetic word problems in GSM8K's format, written by a seeded generator (no dataset can be
downloaded on the machines this project runs on): each row is `{"question", "answer"}`, the
answer a short worked solution ending in `#### N`, exactly as GSM8K writes it.

    python examples/math/problems.py            # rewrites data/train.jsonl and data/eval.jsonl

The same seed writes byte-identical files (tests/unit/rlgateway/test_examples_data.py checks the
checked-in ones). Problems take one or two steps of +, - and x on numbers up to 20, sized for
SmolLM2-135M-Instruct: it solves some of them, not most.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

NAMES = ("Tom", "Sara", "Ben", "Lina", "Omar", "Mia", "Ravi", "Ana", "Leo", "Zoe", "Kai", "Ivy")
THINGS = ("apples", "marbles", "stickers", "pencils", "cookies", "books", "coins", "shells")


def _add(r: random.Random) -> tuple[str, str]:
    n, t, a, b = r.choice(NAMES), r.choice(THINGS), r.randint(2, 20), r.randint(2, 20)
    q = f"{n} has {a} {t}. {n} gets {b} more {t}. How many {t} does {n} have now?"
    return q, f"{n} has {a} + {b} = {a + b} {t}.\n#### {a + b}"


def _sub(r: random.Random) -> tuple[str, str]:
    n, t = r.choice(NAMES), r.choice(THINGS)
    a = r.randint(5, 20)
    b = r.randint(1, a - 1)
    q = f"{n} had {a} {t} and gave away {b} of them. How many {t} does {n} have left?"
    return q, f"{n} has {a} - {b} = {a - b} {t} left.\n#### {a - b}"


def _mul(r: random.Random) -> tuple[str, str]:
    n, t, a, b = r.choice(NAMES), r.choice(THINGS), r.randint(2, 9), r.randint(2, 6)
    q = f"{n} has {b} bags with {a} {t} in each bag. How many {t} does {n} have in all?"
    return q, f"{n} has {b} x {a} = {a * b} {t}.\n#### {a * b}"


def _two_step(r: random.Random) -> tuple[str, str]:
    n, t = r.choice(NAMES), r.choice(THINGS)
    a, b = r.randint(3, 15), r.randint(2, 10)
    c = r.randint(1, a + b - 1)
    q = (
        f"{n} has {a} {t}, finds {b} more, then gives {c} to a friend. "
        f"How many {t} does {n} have now?"
    )
    s = a + b
    return q, f"{n} has {a} + {b} = {s} {t}, then {s} - {c} = {s - c}.\n#### {s - c}"


KINDS = (_add, _sub, _mul, _two_step)


def problems(n: int, seed: int) -> list[dict[str, str]]:
    r = random.Random(seed)
    out = []
    for _ in range(n):
        q, a = r.choice(KINDS)(r)
        out.append({"question": q, "answer": a})
    return out


def write(folder: Path, *, train: int = 2000, eval: int = 256, seed: int = 0) -> None:
    """Train and eval splits from disjoint seeds; eval questions that also occur in train are
    replaced, so the held-out split is held out."""
    folder.mkdir(parents=True, exist_ok=True)
    train_rows = problems(train, seed)
    seen = {p["question"] for p in train_rows}
    eval_rows: list[dict[str, str]] = []
    extra = 0
    while len(eval_rows) < eval:
        for p in problems(eval, seed + 1_000_003 + extra):
            if p["question"] not in seen and len(eval_rows) < eval:
                seen.add(p["question"])
                eval_rows.append(p)
        extra += 1
    for name, rows in (("train.jsonl", train_rows), ("eval.jsonl", eval_rows)):
        text = "".join(json.dumps(row) + "\n" for row in rows)
        (folder / name).write_text(text)


if __name__ == "__main__":
    write(Path(__file__).resolve().parent / "data")
