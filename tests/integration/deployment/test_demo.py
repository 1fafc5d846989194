"""`rlgateway demo` as a user runs it (a subprocess), CI-sized: a short training run and a short
control run, each checked through its outputs and the store it wrote."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.gateway_server import REPO_ROOT

pytestmark = pytest.mark.slow

SMALL = ["--warm-start-steps", "4", "--workers", "2", "--group-size", "4", "--groups-per-step", "2"]


def demo(out: Path, *args: str) -> tuple[str, dict[str, Any]]:
    proc = subprocess.run(
        [sys.executable, "-m", "rlgateway.cli", "demo", "--out", str(out), *SMALL, *args],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout, json.loads((out / "summary.json").read_text())


def sessions(out: Path, run_id: str) -> list[tuple[bool, str, str | None, float | None]]:
    """(ended, train_state, group_id, reward) of each session of the run."""
    with sqlite3.connect(out / "demo.db") as db:
        rows = db.execute(
            "SELECT s.ended_at IS NOT NULL, s.train_state, s.group_id, r.value FROM sessions s "
            "LEFT JOIN rewards r ON r.session_id = s.id WHERE s.run_id = ?",
            (run_id,),
        )
        return list(rows)


def test_demo_trains_and_reports(tmp_path: Path) -> None:
    # grpo (the default, named because the test relies on it): dapo's dynamic sampling would drop
    # the all-zero groups of this barely warm-started model, and the test wants 3 steps.
    stdout, summary = demo(tmp_path, "--algorithm", "grpo", "--minutes", "3", "max_steps=3")
    assert summary["trained"] is True
    assert summary["steps"] == 3, "the trainer's max_steps ends the demo"
    assert 0.0 <= summary["reward_start"] <= 1.0
    assert 0.0 <= summary["reward_end"] <= 1.0
    assert summary["seconds"] > 0
    assert summary["curve"], "no row of the live table"
    assert (tmp_path / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "time episodes  reward version" in stdout
    assert f"GET /runs/{summary['run_id']}" in stdout
    # the closing lines say how to get the trained policy out: the printed command works
    [export] = [line.split() for line in stdout.splitlines() if " export-model " in line]
    assert Path(export[0]).is_file(), "the command is given by its path in this venv"
    done = subprocess.run(export, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    policy = json.loads((tmp_path / "model" / "rlgateway_policy.json").read_text())
    assert policy["version"] == 3, "the newest checkpoint's policy"
    assert f"serve --model {tmp_path / 'model'} --database-url" in stdout

    with sqlite3.connect(tmp_path / "demo.db") as db:
        [(status,)] = db.execute("SELECT status FROM runs WHERE id = ?", (summary["run_id"],))
    assert status == "stopped", "the demo's run ends with the demo"

    rows = sessions(tmp_path, summary["run_id"])
    consumed = [r for r in rows if r[1] == "consumed"]
    assert len(consumed) >= 3 * 8, "three steps of two groups of four"
    assert all(r[0] and r[3] in (0.0, 1.0) for r in consumed)
    groups: dict[str | None, int] = {}
    for r in consumed:
        groups[r[2]] = groups.get(r[2], 0) + 1
    assert set(groups.values()) == {4}, "whole GRPO groups are trained"
    versions = [row["version"] for row in summary["curve"]]
    assert versions == sorted(versions)
    assert max(versions) >= 1, "the agents were served the trained policy"


def test_demo_without_training_is_the_control(tmp_path: Path) -> None:
    _, summary = demo(tmp_path, "--no-train", "--minutes", "0.25")
    assert summary["trained"] is False
    assert summary["steps"] == 0
    assert all(row["version"] == 0 for row in summary["curve"])
    rows = sessions(tmp_path, summary["run_id"])
    assert rows
    assert all(r[1] != "consumed" for r in rows)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--group-size", "1"], "--group-size must be at least 2"),
        (["--minutes", "0"], "--minutes must be positive"),
        (["--algorithm", "nope"], "unknown --algorithm 'nope'"),
        (["--engine", "vllm"], "--engine vllm needs --model DIR"),
        (["--model", "/nonexistent"], "is not a Hugging Face model directory"),
        # a run-config override: the key, what is wrong, what is allowed; before the warm start
        (["optim.lrr=1"], "override: optim.lrr: unknown key (known here: lr, weight_decay"),
        (["eta=-1"], "override: eta: Input should be greater than or equal to 0 (got -1)"),
        (["partial_groups=x"], "Input should be 'wait', 'drop' or 'use' (got 'x')"),
        (["lr"], "override: override 'lr' is not KEY=VALUE"),
    ],
)
def test_demo_rejects_bad_flags_before_loading_anything(
    tmp_path: Path, flags: list[str], message: str
) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "rlgateway.cli", "demo", *flags],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "warm start" not in proc.stdout
    assert not (tmp_path / "demo-out").exists()
