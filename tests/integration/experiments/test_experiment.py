"""`rlgateway run` and `Experiment` as a user runs them, on the tiny model: the whole loop
(gateway, trainer, rollouts, evaluation, outputs), resuming without repeating or skipping a row,
and every way a user's part can fail (a raising grader, a hanging one, an agent program that
crashes) recorded as the session's outcome while the run goes on."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlgateway.experiment.runner import Experiment
from tests.support.experiment import (
    FILES,
    answered_rows,
    metrics,
    open_sessions,
    store_sessions,
    trained_steps,
    write_spec,
)
from tests.support.gateway_server import REPO_ROOT

pytestmark = pytest.mark.slow


def test_run_trains_evaluates_and_resumes_without_repeating_a_row(tmp_path: Path) -> None:
    rows = [{"q": f"question {i}", "mode": "ok"} for i in range(5)]
    spec = write_spec(tmp_path / "spec", rows)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "rlgateway.cli", "run", str(spec), "--out", str(out)]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2
    assert (out / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((out / "tb").iterdir()), "no TensorBoard event file"
    got = metrics(out)
    evals = [r for r in got if "eval_rows" in r]
    # the base policy, then as the trainer passes each multiple of eval.every (evaluating the
    # step it finds: a fast trainer may be past it), and the final policy
    steps = [r["step"] for r in evals]
    assert steps[0] == 0
    assert steps[-1] == 2
    assert steps == sorted(set(steps))
    assert all(0.0 <= r["eval_accuracy"] <= 1.0 and r["eval_rows"] == 3 for r in evals)
    assert [r["step"] for r in got if "reward_mean" in r and "eval_rows" not in r] == [1, 2]
    # the page charts the evaluation run's steps: the same rows, in the store
    state = json.loads((out / "experiment.json").read_text())
    with sqlite3.connect(out / "store.db") as db:
        charted = db.execute(
            "SELECT step, metrics FROM train_steps WHERE run_id = ? ORDER BY step",
            (state["eval_run_id"],),
        ).fetchall()
    assert [step for step, _ in charted] == steps
    assert [json.loads(m)["eval_accuracy"] for _, m in charted] == [
        r["eval_accuracy"] for r in evals
    ]

    # again, two more steps: the trainer resumes from its checkpoint, the rows from the store
    again = subprocess.run(
        [*cmd, "max_steps=4"], capture_output=True, text=True, timeout=600, cwd=REPO_ROOT
    )
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["steps"] == 4
    state = json.loads((out / "experiment.json").read_text())
    sessions = store_sessions(out, state["run_id"])
    groups: dict[str, list[dict[str, Any]]] = {}
    for s in sessions:
        groups.setdefault(s["group_id"], []).append(s)
    answered = [
        (g[0]["metadata"]["epoch"], g[0]["metadata"]["index"])
        for g in groups.values()
        if any(s["ended_at"] is not None and s["outcome"] != "failed" for s in g)
    ]
    assert len(answered) == len(set(answered)), "a row was answered twice"
    # the rows handed out are a prefix of the stream: epoch by epoch, no index skipped
    by_epoch: dict[int, set[int]] = {}
    for epoch, index in answered:
        by_epoch.setdefault(epoch, set()).add(index)
    last = max(by_epoch)
    for epoch, indices in by_epoch.items():
        if epoch < last:
            assert indices == set(range(5)), f"epoch {epoch} skipped a row: {sorted(indices)}"
    assert len(answered) >= 8, "4 steps of 2 groups each"
    # the first run's evaluation rows are kept; the second evaluated later steps only
    later = [r["step"] for r in metrics(out) if "eval_rows" in r][len(steps) :]
    assert later
    assert later[-1] == 4
    assert all(s > 2 for s in later)


def test_failing_parts_are_recorded_and_the_run_goes_on(tmp_path: Path) -> None:
    rows = [{"q": f"question {i}", "mode": m} for i, m in enumerate(["ok", "boom", "hang", "ok"])]
    spec = write_spec(
        tmp_path / "spec",
        rows,
        reward={"fn": str(FILES / "parts.py") + ":flaky", "timeout": 0.5, "executor": "process"},
        train={"max_steps": 1},
        eval={"every": 0},
    )
    out = tmp_path / "out"
    summary = Experiment.from_yaml(spec, out=out).run()
    assert summary["steps"] == 1
    assert summary["failures"].get("reward_error", 0) >= 2, summary
    assert summary["failures"].get("reward_timeout", 0) >= 2, summary
    sessions = store_sessions(out, summary["run_id"])
    failed = [s for s in sessions if s["outcome"] == "failed"]
    reasons = {s["failure"] for s in failed}
    assert any("the grader broke on this row" in r for r in reasons), reasons
    assert any(r.startswith("reward timeout") for r in reasons), reasons
    modes = {rows[int(s["metadata"]["prompt"].split()[-1])]["mode"] for s in failed}
    assert modes <= {"boom", "hang"}, reasons
    assert any(s["outcome"] == "trained" for s in sessions)


def test_a_crashing_agent_program_is_recorded_and_the_run_goes_on(tmp_path: Path) -> None:
    rows = [{"q": f"question {i}", "mode": m} for i, m in enumerate(["ok", "crash", "ok"])]
    spec = write_spec(
        tmp_path / "spec",
        rows,
        workflow={"type": "agent", "command": ["python", str(FILES / "agent.py")], "timeout": 60},
        train={"max_steps": 1},
        eval={"every": 0},
    )
    del_eval = yaml.safe_load(spec.read_text())
    del_eval["dataset"].pop("eval_path")
    spec.write_text(yaml.safe_dump(del_eval))
    out = tmp_path / "out"
    summary = Experiment.from_yaml(spec, out=out).run()
    assert summary["steps"] == 1
    assert summary["failures"].get("agent", 0) >= 2
    sessions = store_sessions(out, summary["run_id"])
    failed = [s for s in sessions if s["outcome"] == "failed"]
    assert failed
    assert all("exited with status 3" in s["failure"] for s in failed)
    assert all("the agent fell over" in s["failure"] for s in failed)
    assert any(s["outcome"] == "trained" for s in sessions)


def test_smollm2_math_trains_evaluates_and_resumes_mid_epoch(tmp_path: Path) -> None:
    """The real model on four GSM8K-style problems: a step, an evaluation row, and a second run
    that continues the epoch where the first stopped."""
    from examples.math.problems import problems

    folder = tmp_path / "spec"
    folder.mkdir()
    rows = problems(4, seed=3)
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in problems(2, seed=4)))
    spec = {
        "name": "math-smoke",
        "model": "smollm2",
        "dataset": {
            "path": "train.jsonl",
            "eval_path": "eval.jsonl",
            "fields": {"prompt": "question"},
            "required": ["prompt", "answer"],
        },
        "workflow": {"type": "single_turn", "prompt": "{prompt} Answer with just the number."},
        "reward": {"fn": "math_answer"},
        "train": {
            "group_size": 2,
            "batch_size": 2,
            "max_steps": 1,
            "max_tokens": 24,
            "optim": {"lr": 1e-6},
        },
        "concurrency": 1,
        "eval": {"every": 0},
    }
    (folder / "spec.yaml").write_text(yaml.safe_dump(spec))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "rlgateway.cli", "run", str(folder / "spec.yaml"), "--out"]
    first = subprocess.run(
        [*cmd, str(out)], capture_output=True, text=True, timeout=900, cwd=REPO_ROOT
    )
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    evals = [r for r in metrics(out) if "eval_rows" in r]
    assert [r["step"] for r in evals] == [0, 1]
    assert all(r["eval_rows"] == 2 and 0.0 <= r["eval_accuracy"] <= 1.0 for r in evals)
    before = answered_rows(out)
    assert before
    assert all(epoch == 0 for epoch, _ in before)
    assert len(before) < 4, "the first run stops mid-epoch"

    # the first run may have answered groups it never trained (in flight when it stopped); the
    # second trains one group per step, each a row answered once, so one step more than the rows
    # answered so far makes it answer rows of its own
    steps = len(before) + 1
    second = subprocess.run(
        [*cmd, str(out), f"max_steps={steps}"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO_ROOT,
    )
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["steps"] == steps
    after = answered_rows(out)
    assert after[: len(before)] == before
    assert len(after) == len(set(after)), "a row was answered twice"
    stream = [(epoch, index) for epoch in range(3) for index in range(4)]
    assert sorted(after) == stream[: len(after)], "a row of the stream was skipped"
    assert len(after) > len(before)


def test_an_experiment_drives_a_running_deployment(tmp_path: Path, tiny_model: Path) -> None:
    """`--gateway-url`: a gateway with its trainer (`rlgateway serve --train`, a process of its
    own) trains the run; the experiment only speaks HTTP to it."""
    from tests.support.gateway_server import run_gateway

    config = tmp_path / "run.yaml"
    train = {
        "group_size": 2,
        "batch_size": 4,
        "max_steps": 2,
        "max_tokens": 6,
        "checkpoint_dir": str(tmp_path / "ckpt"),
        "tensorboard": False,
        "optim": {"lr": 1e-3},
    }
    config.write_text(yaml.safe_dump(train))
    rows = [{"q": f"question {i}", "mode": "ok"} for i in range(5)]
    spec = write_spec(tmp_path / "spec", rows, train={"max_steps": 2}, eval={"every": 0})
    out = tmp_path / "out"
    with run_gateway(tiny_model, tmp_path, extra_args=("--train", "--config", str(config))) as gw:
        run_id = gw.trained_run()
        exp = Experiment.from_yaml(
            spec, out=out, gateway_url=gw.url, admin_token=gw.admin_token, run_id=run_id
        )
        summary = exp.run()
        assert summary["steps"] == 2
        assert summary["run_id"] == run_id
        listed = gw.client.get(f"/runs/{run_id}/sessions", params={"limit": 500}).json()
        assert listed["total"] == summary["episodes"]
        assert gw.client.get("/admin/version").json()["version"] == 2
    evals = [r for r in metrics(out) if "eval_rows" in r]
    assert evals[0]["step"] == 0
    assert evals[-1]["step"] == 2
    assert [r["step"] for r in metrics(out) if "eval_rows" not in r] == [1, 2]


def test_multi_turn_episodes_credit_the_turn_that_solved_them(tmp_path: Path) -> None:
    """The built-in multi-turn workflow: a wrong answer gets the environment's feedback and
    another try; the reward is posted for the turn that solved it (its completion id), a failed
    episode gets a final 0, and the trainer trains both kinds."""
    # one step is two groups: both rows
    rows = [{"q": "question 0", "mode": "never"}, {"q": "question 1", "mode": "ok"}]
    spec = write_spec(
        tmp_path / "spec",
        rows,
        workflow={
            "type": "multi_turn",
            "prompt": "{prompt}",
            "max_turns": 3,
            "feedback": "No ({turn}). Again.",
        },
        reward={"fn": str(FILES / "parts.py") + ":every_second_try"},
        train={"max_steps": 1, "discount": 0.5},
        eval={"every": 0},
    )
    out = tmp_path / "out"
    summary = Experiment.from_yaml(spec, out=out).run()
    assert summary["steps"] == 1
    with sqlite3.connect(out / "store.db") as db:
        rewards = db.execute(
            "SELECT r.session_id, r.value, r.completion_id, "
            "(SELECT COUNT(*) FROM completions c WHERE c.session_id = r.session_id) "
            "FROM rewards r JOIN sessions s ON s.id = r.session_id WHERE s.run_id = ?",
            (summary["run_id"],),
        ).fetchall()
    assert rewards
    for _, value, completion_id, turns in rewards:
        if value == 1.0:  # solved: credited at the solving turn, the episode's last
            assert completion_id is not None
        else:  # three wrong answers: a final reward of 0
            assert (value, completion_id, turns) == (0.0, None, 3)
    assert any(v == 1.0 and turns > 1 for _, v, _, turns in rewards), "none solved after feedback"
    assert any(v == 0.0 for _, v, _, _ in rewards), "no episode failed all its turns"


STEPS = 5
"""The killed run's steps: each after the first is another moment to kill it in."""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["kill-9", "ctrl-c"])
def test_a_killed_run_resumes_with_every_session_ended_and_no_row_answered_twice(
    tmp_path: Path, sig: signal.Signals
) -> None:
    """`kill -9`, or Ctrl-C (SIGINT to the process group, as a terminal sends it), on `rlgateway
    run` (gateway, trainer and rollouts in one process) as its first step lands, with episodes
    and an evaluation in flight. Ctrl-C stops it at once (exit 130, no traceback: what is in
    flight is left as a kill leaves it). Run again: the episodes cut short are ended as failed
    (both runs: training and evaluation), no row is answered twice, the rows answered are a
    prefix of the stream, and the run reaches its steps."""
    rows = [{"q": f"question {i}", "mode": "ok"} for i in range(5)]
    spec = write_spec(
        tmp_path / "spec",
        rows,
        reward={"fn": str(FILES / "parts.py") + ":slow_even_length", "timeout": 10.0},
        train={"max_steps": STEPS},
        concurrency=3,
    )
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "rlgateway.cli", "run", str(spec), "--out", str(out)]
    for _attempt in range(3):  # a starved machine can run all the steps before the moment comes
        rc, seen, ended_alone = _run_and_kill(cmd, out, sig)
        if not ended_alone:
            break
        shutil.rmtree(out)
    assert not ended_alone, "3 runs without both runs' episodes in flight before the last step"
    runs = tuple(json.loads((out / "experiment.json").read_text())[k] for k in RUN_KEYS)
    assert any(x.startswith("step    1") for x in seen), "".join(seen)[-3000:]
    if sig == signal.SIGINT:
        said = "".join(seen)
        assert rc == 130, said[-3000:]
        assert "interrupted; its checkpoints and store are in" in said
        assert "Traceback" not in said, said[-3000:]
    assert all(open_sessions(out, run) for run in runs), "the kill cut nothing short"
    before = answered_rows(out)

    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["steps"] == STEPS
    for run in runs:
        assert not open_sessions(out, run), f"sessions left open in {run}"
    after = answered_rows(out)
    assert after[: len(before)] == before
    assert len(after) == len(set(after)), "a row was answered twice"
    last = max(epoch for epoch, _ in after)
    assert last > 0, "five steps of two groups go past the first epoch of five rows"
    for epoch in range(last):  # the rows the kill cut short were handed out again
        got = sorted(i for e, i in after if e == epoch)
        assert got == list(range(5)), f"epoch {epoch} skipped a row: {got}"


RUN_KEYS = ("run_id", "eval_run_id")


def _run_and_kill(cmd: list[str], out: Path, sig: signal.Signals) -> tuple[int, list[str], bool]:
    """Start `rlgateway run`; once its first step landed, send `sig` to its process group as
    soon as the training run and the evaluation run both have an episode in flight. Returns its
    exit status, what it printed, and whether no such moment came before the run's last step
    (then it is left to finish: nothing is sent)."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO_ROOT,
        start_new_session=True,
    )
    seen = []
    moment = False
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("step    1"):
                break
        # the first step landed: the next step's episodes and the step's evaluation start; kill
        # as soon as both have an episode in flight (each step brings an evaluation, so a busy
        # machine that misses one moment gets another, STEPS - 1 in all: one CI run missed two)
        state = json.loads((out / "experiment.json").read_text())
        runs = [state[k] for k in RUN_KEYS]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if trained_steps(out, runs[0]) >= STEPS - 1:
                break  # too late: the run is in its last step or winding down
            if all(open_sessions(out, run) for run in runs):
                moment = True
                break
            time.sleep(0.05)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    finally:
        if moment:
            os.killpg(proc.pid, sig)
        if proc.stdout is not None:
            seen.append(proc.stdout.read())  # to its end: the process exits
        rc = proc.wait(timeout=600)
        if proc.stdout is not None:
            proc.stdout.close()
    return rc, seen, not moment
