"""The demo's task, generated in code: follow a length instruction exactly. Pure functions.

    user: Write exactly five lowercase letters.          assistant: qhzta

The grader gives 1 when the reply is exactly that many lowercase ASCII letters (nothing else: no
capitals, digits, spaces, punctuation or special tokens) and 0 otherwise, so there is nothing to
game but the instruction itself. The lengths asked for are three, five and seven.

The warm start learns from a *sloppy teacher* (`teacher_answer`): it writes a random number of
characters (two to eight), and only 60% of the time sticks to lowercase letters. Imitating it
gives a policy that knows the shape of an answer and follows the instruction only by chance
(a few percent); the grader's reward has to teach it to count and to stay in lowercase. The
`--no-train` run shows where the warm start alone stays.
"""

from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass

TASK_VERSION = 3
"""Bump when problems, prompts or the teacher change (cached warm starts are keyed by it)."""

MAX_TOKENS = 10
"""New tokens an answer may take."""

LENGTHS = {3: "three", 5: "five", 7: "seven"}

LONGEST_ANSWER = max(LENGTHS) + 1
"""Tokens of the longest right answer: seven letters (one token each) and the end token."""

SLOPPY_CHARS = string.ascii_letters + string.digits + " .,!"


@dataclass(frozen=True, slots=True)
class Problem:
    """One instruction of the task; `id` names it (and its GRPO group's prompt)."""

    id: str
    prompt: str
    length: int


def all_problems() -> list[Problem]:
    return [
        Problem(f"letters-{n}", f"Write exactly {word} lowercase letters.", n)
        for n, word in LENGTHS.items()
    ]


def grade(problem: Problem, text: str | None) -> float:
    """1.0 when `text` is exactly `problem.length` lowercase ASCII letters, else 0.0."""
    return 1.0 if re.fullmatch(f"[a-z]{{{problem.length}}}", text or "") else 0.0


def teacher_answer(problem: Problem, rng: random.Random) -> str:
    """A demonstration from the sloppy teacher: 2 to 8 characters (whatever was asked), lowercase
    letters 60% of the time, any of letters, digits and punctuation otherwise."""
    del problem  # the teacher does not read the instruction
    chars = string.ascii_lowercase if rng.random() < 0.6 else SLOPPY_CHARS
    return "".join(rng.choice(chars) for _ in range(rng.randint(2, 8)))
