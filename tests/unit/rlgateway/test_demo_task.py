"""The demo's task, grader, teacher and summary: pure functions."""

from __future__ import annotations

import io
import random
from collections import Counter

import pytest

from rlgateway.demo.harness import Episode
from rlgateway.demo.report import Progress, summarize
from rlgateway.demo.task import all_problems, grade, teacher_answer


def test_problems_ask_for_three_five_or_seven_letters() -> None:
    problems = all_problems()
    assert [p.length for p in problems] == [3, 5, 7]
    assert problems[1].prompt == "Write exactly five lowercase letters."
    assert len({p.id for p in problems}) == 3


@pytest.mark.parametrize(
    ("text", "reward"),
    [
        ("qhzta", 1.0),
        ("qhzt", 0.0),
        ("qhztab", 0.0),
        ("qhzTa", 0.0),
        (" qhzta", 0.0),
        ("qhzta\n", 0.0),
        ("qh<tool_call>", 0.0),
        ("", 0.0),
        (None, 0.0),
    ],
)
def test_grader_wants_exactly_that_many_lowercase_letters(text: str | None, reward: float) -> None:
    assert grade(all_problems()[1], text) == reward


def test_the_teacher_ignores_the_instruction_and_is_sloppy() -> None:
    rng = random.Random(0)
    five = all_problems()[1]
    answers = [teacher_answer(five, rng) for _ in range(20_000)]
    assert Counter(len(a) for a in answers).keys() == set(range(2, 9))
    lowercase = sum(a.isalpha() and a.islower() and a.isascii() for a in answers) / len(answers)
    assert 0.58 < lowercase < 0.64
    right = sum(grade(five, a) for a in answers) / len(answers)
    assert 0.07 < right < 0.10  # 1/7 of the lengths, lowercase 60% (+ sloppy luck)


def episode(t: float, reward: float, version: int) -> Episode:
    return Episode(t=t, reward=reward, version=version, completion_tokens=2, problem_id="letters-5")


def test_progress_rows_and_summary_use_windows_of_episodes() -> None:
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
    header = ["time", "episodes", "reward", "version", "step", "stale", "loss", "tok/s"]
    assert lines[0].split() == header
    assert len(lines) == 6
    s = summarize(progress.rows, trained=True, seconds=20.0, steps=4)
    assert s["reward_start"] == 0.25
    assert s["reward_end"] == 0.75
    assert s["episodes"] == 20
    assert s["trained"] is True
    assert s["steps"] == 4


def test_the_demo_run_config_never_penalises_a_right_answer() -> None:
    """DAPO's overlong shaping must leave the longest right answer (7 letters + end) alone."""
    from pathlib import Path

    import torch

    from rlgateway.demo.run import DemoOptions, train_config
    from rlgateway.demo.task import LONGEST_ANSWER, MAX_TOKENS
    from trainer.algorithms.shaping import overlong_shaping

    o = DemoOptions(
        model_dir=Path("m"),
        out=Path("o"),
        train=True,
        minutes=1.0,
        seed=0,
        algorithm="dapo",
        lr=2e-4,
        group_size=8,
        groups_per_step=4,
        eta=1,
        workers=2,
    )
    algo = train_config(o, "run", "sqlite:///x").algorithm_config()
    assert algo.overlong_buffer is not None
    shaped = overlong_shaping(
        torch.tensor([1.0, 1.0]),
        torch.tensor([LONGEST_ANSWER, MAX_TOKENS]),
        max_len=MAX_TOKENS,
        overlong_buffer=algo.overlong_buffer,
    )
    assert shaped[0] == 1.0
    assert shaped[1] < 1.0


def test_an_episode_crosses_the_agents_process_boundary_whole() -> None:
    # the demo's agents run as a process of their own and hand each episode over as a JSON line
    ep = Episode(t=1.5, reward=1.0, version=-1, completion_tokens=6, problem_id="letters-5")
    line = ep.to_json()
    assert "\n" not in line
    assert Episode.from_json(line) == ep


def test_the_agents_program_refuses_to_start_without_the_admin_token(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from rlgateway.demo import harness

    monkeypatch.delenv(harness.ADMIN_TOKEN_ENV, raising=False)
    with pytest.raises(SystemExit) as exc:
        harness.main(["--url", "http://127.0.0.1:1", "--run", "run_x"])
    assert exc.value.code == 2
    assert harness.ADMIN_TOKEN_ENV in capsys.readouterr().err
