"""The demo's task, generated in code: name the largest of four digits. Pure functions, no torch.

    user: Largest of 7 2 9 4?          assistant: 9

The reward is 1 for the right digit and 0 otherwise (the grader strips whitespace). The warm start
learns from a *sloppy teacher* (`teacher_answer`) that always answers with one of the four digits
but picks the largest only by chance, so the warm-started policy knows the format (copy a digit
of the question) and gets about a third right. RL with the exact-answer reward has to teach it to
compare; the `--no-train` run shows where the warm start alone stays.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

TASK_VERSION = 1
"""Bump when problems, prompts or the teacher change (cached warm starts are keyed by it)."""

MAX_TOKENS = 4
"""New tokens an answer may take: a digit and the end-of-turn token, plus two to spare."""

DIGITS = 4
"""Digits per question."""


@dataclass(frozen=True, slots=True)
class Problem:
    """One question of the task; `id` names it (and its GRPO group's prompt)."""

    id: str
    prompt: str
    answer: str


def make_problem(digits: tuple[int, ...]) -> Problem:
    text = " ".join(str(d) for d in digits)
    return Problem("".join(str(d) for d in digits), f"Largest of {text}?", str(max(digits)))


def all_problems() -> list[Problem]:
    """Every question with four distinct digits in some order (5040 of them): a tie would let a
    guess be right by luck more often, so there are none."""
    from itertools import permutations

    return [make_problem(p) for p in permutations(range(10), DIGITS)]


def grade(problem: Problem, text: str | None) -> float:
    """1.0 for exactly the largest digit, else 0.0."""
    return 1.0 if (text or "").strip() == problem.answer else 0.0


def teacher_answer(problem: Problem, rng: random.Random) -> str:
    """A demonstration from the sloppy teacher: one of the question's digits, uniformly."""
    return rng.choice(problem.id)
