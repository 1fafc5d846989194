"""The demo's task, grader, teacher and summary: pure functions."""

from __future__ import annotations

import random

import pytest

from gateway.demo.harness import Episode
from gateway.demo.report import Progress, summarize
from gateway.demo.task import all_problems, grade, make_problem, teacher_answer


def test_problems_are_distinct_digit_questions_with_the_largest_as_answer() -> None:
    problems = all_problems()
    assert len(problems) == 10 * 9 * 8 * 7
    assert len({p.id for p in problems}) == len(problems)
    p = make_problem((7, 2, 9, 4))
    assert p.prompt == "Largest of 7 2 9 4?"
    assert p.answer == "9"
    for q in problems[:: len(problems) // 50]:
        digits = [int(c) for c in q.id]
        assert len(set(digits)) == 4
        assert q.answer == str(max(digits))


@pytest.mark.parametrize(
    ("text", "reward"), [("9", 1.0), (" 9\n", 1.0), ("7", 0.0), ("99", 0.0), ("", 0.0), (None, 0.0)]
)
def test_grader_wants_exactly_the_largest_digit(text: str | None, reward: float) -> None:
    assert grade(make_problem((7, 2, 9, 4)), text) == reward


def test_the_teacher_answers_with_a_digit_of_the_question_and_is_right_a_quarter_of_the_time() -> (
    None
):
    rng = random.Random(0)
    problems = all_problems()
    right = 0
    for i in range(4000):
        p = problems[i % len(problems)]
        a = teacher_answer(p, rng)
        assert a in p.id
        right += a == p.answer
    assert 0.22 < right / 4000 < 0.28


def episode(t: float, reward: float, version: int) -> Episode:
    return Episode(t=t, reward=reward, version=version, completion_tokens=2, problem_id="0123")


def test_progress_rows_and_summary_use_windows_of_episodes() -> None:
    import io

    out = io.StringIO()
    progress = Progress(window=4, out=out)
    progress.start()
    rewards = [0, 0, 0, 1] * 2 + [1, 1, 1, 0] * 3  # 5 windows: 0.25, 0.25, 0.75, 0.75, 0.75
    for i, r in enumerate(rewards):
        progress.on_episode(episode(float(i + 1), float(r), version=i // 4))
    assert [row.reward for row in progress.rows] == [0.25, 0.25, 0.75, 0.75, 0.75]
    assert [row.version for row in progress.rows] == [0, 1, 2, 3, 4]
    assert progress.rows[0].tokens_per_s == pytest.approx(8 / 4)
    lines = out.getvalue().splitlines()
    assert lines[0].split() == [
        "time",
        "episodes",
        "reward",
        "version",
        "step",
        "stale",
        "loss",
        "tok/s",
    ]
    assert len(lines) == 6
    s = summarize(progress.rows, trained=True, seconds=20.0, steps=4)
    assert s["reward_start"] == 0.25
    assert s["reward_end"] == 0.75
    assert s["episodes"] == 20
    assert s["trained"] is True
    assert s["steps"] == 4
