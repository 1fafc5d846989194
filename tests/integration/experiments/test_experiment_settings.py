"""An experiment spec's workflow and evaluation settings act, seen in what the store recorded:
`workflow.system` reaches the model, `workflow.solved` ends an episode, `eval.limit` and
`eval.samples` set what is evaluated, `eval.solved` what counts as correct."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from rlgateway.experiment.runner import Experiment
from tests.support.experiment import metrics, write_spec

pytestmark = pytest.mark.slow


def test_workflow_and_eval_settings_act(tmp_path: Path) -> None:
    rows = [{"q": f"question {i}", "mode": "ok"} for i in range(4)]
    spec = write_spec(
        tmp_path / "spec",
        rows,
        workflow={
            "type": "multi_turn",
            "prompt": "{prompt}",
            "system": "You are the system under test.",
            "max_turns": 3,
            "solved": 0.0,  # any reward ends the episode: one turn each
        },
        train={"max_steps": 1},
        eval={"every": 0, "limit": 2, "samples": 2, "solved": 0.0},
    )
    out = tmp_path / "out"
    summary = Experiment.from_yaml(spec, out=out).run()
    assert summary["steps"] == 1

    evals = [r for r in metrics(out) if "eval_rows" in r]
    assert [r["step"] for r in evals] == [0, 1]
    for r in evals:
        assert r["eval_rows"] == 2  # eval.limit of the three eval rows
        assert r["eval_accuracy"] == 1.0  # eval.solved 0: every graded answer counts
        assert 0.0 <= r["eval_greedy_reward"] <= 1.0
        assert 0.0 <= r["eval_reward_mean"] <= 1.0  # eval.samples: k answers at temperature
        assert "eval_pass_at_2" in r

    state = json.loads((out / "experiment.json").read_text())
    with sqlite3.connect(out / "store.db") as db:
        eval_sessions = db.execute(
            "SELECT metadata FROM sessions WHERE run_id = ?", (state["eval_run_id"],)
        ).fetchall()
        turns = db.execute(
            "SELECT s.id, COUNT(c.id) FROM sessions s JOIN completions c ON c.session_id = s.id "
            "GROUP BY s.id"
        ).fetchall()
        requests = [json.loads(r) for (r,) in db.execute("SELECT request FROM completions")]
    per_step: dict[int, int] = {}
    for (meta,) in eval_sessions:
        step = json.loads(meta)["eval_step"]
        per_step[step] = per_step.get(step, 0) + 1
    assert per_step == {0: 2 * 3, 1: 2 * 3}  # 2 rows x (1 greedy + 2 samples)
    assert turns
    assert all(n == 1 for _, n in turns), "workflow.solved 0 ends every episode at its first turn"
    assert requests
    for request in requests:
        assert request["messages"][0] == {
            "role": "system",
            "content": "You are the system under test.",
        }
