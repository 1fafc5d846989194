"""The examples' checked-in data is what their seeded generator writes, their specs load, and
every problem's answer is what the built-in grader accepts."""

from __future__ import annotations

from pathlib import Path

import pytest

from examples.math.problems import write
from rlgateway.experiment.dataset import load
from rlgateway.experiment.graders import math_answer
from rlgateway.experiment.spec import load_spec
from rlgateway.experiment.workflows import render
from tests.support.paths import REPO_ROOT

EXAMPLES = REPO_ROOT / "examples"


def test_the_checked_in_problems_are_the_generators(tmp_path: Path) -> None:
    write(tmp_path)
    for name in ("train.jsonl", "eval.jsonl"):
        assert (tmp_path / name).read_bytes() == (EXAMPLES / "math" / "data" / name).read_bytes()


@pytest.mark.parametrize("spec", ["math/math.yaml", "multiturn/multiturn.yaml"])
def test_the_example_specs_load_and_their_rows_render(spec: str) -> None:
    path = EXAMPLES / spec
    s = load_spec(path)
    splits = load(s.dataset, base_dir=path.parent)
    assert len(splits.train) == 2000
    assert len(splits.eval) == 256
    held_out = {r["prompt"] for r in splits.eval}
    assert not held_out & {r["prompt"] for r in splits.train}
    assert "Answer with just the number." in render(s.workflow.prompt, splits.eval[0])  # type: ignore[union-attr]


def test_each_worked_answer_earns_the_full_reward() -> None:
    s = load_spec(EXAMPLES / "math" / "math.yaml")
    splits = load(s.dataset, base_dir=EXAMPLES / "math")
    for row in splits.eval:
        final = row["answer"].split("####")[-1].strip()
        assert math_answer(row["prompt"], f"The answer is {final}.", row) == 1.0
        assert math_answer(row["prompt"], f"The answer is {int(final) + 1}.", row) == 0.0
