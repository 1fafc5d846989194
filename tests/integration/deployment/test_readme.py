"""The README's blocks, run as a newcomer pastes them.

Every fenced shell or Python block of README.md carries a tag on the line before it:
`<!-- readme: run -->` (this test runs it) or `<!-- readme: skip: WHY -->` (it cannot run here,
and WHY says which test covers it instead). The `run` blocks are pasted, in order, into one bash
session in an empty directory that has the repository's `.venv` and `configs/` (what a clone
has): shell blocks as they are, Python blocks into `.venv/bin/python`, as the README says. Then
the test checks what they left: the recorded and trained group, the published version, the
exported model, the servers they started.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.gateway_server import REPO_ROOT

README = REPO_ROOT / "README.md"
TAG = re.compile(r"^\s*<!-- readme: (run|skip: .+) -->\s*$")
FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
CODE = {"bash", "sh", "shell", "python"}
PORTS = (8000, 8001)
"""The ports the README's servers listen on."""


@dataclass(frozen=True)
class Block:
    line: int
    language: str
    tag: str | None
    code: str


def readme_blocks(text: str) -> list[Block]:
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, language = m.group(1), m.group(2)
        j = i + 1
        while not re.match(rf"^{indent}```\s*$", lines[j]):
            j += 1
        before = next((x for x in reversed(lines[:i]) if x.strip()), "")
        tag = TAG.match(before)
        code = textwrap.dedent("\n".join(lines[i + 1 : j]))
        blocks.append(Block(i + 1, language, tag.group(1) if tag else None, code + "\n"))
        i = j + 1
    return blocks


def test_every_code_block_of_the_readme_is_run_or_says_why_not() -> None:
    blocks = [b for b in readme_blocks(README.read_text()) if b.language in CODE]
    untagged = [f"README.md:{b.line}" for b in blocks if b.tag is None]
    assert untagged == [], "tag each block <!-- readme: run --> or <!-- readme: skip: WHY -->"
    assert sum(b.tag == "run" for b in blocks) >= 6
    assert all(b.language != "" for b in readme_blocks(README.read_text()) if b.tag)


def script(blocks: list[Block]) -> str:
    parts = ["set -eu"]  # a failing command fails the test; the blocks themselves do not set it
    for b in blocks:
        parts.append(f"echo '### README.md:{b.line}'")
        if b.language == "python":
            parts.append(f".venv/bin/python - <<'README_PY'\n{b.code}README_PY")
        else:
            parts.append(b.code)
    return "\n".join(parts) + "\necho '### done'\n"


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.slow
def test_the_readme_runs_as_pasted(tmp_path: Path) -> None:
    venv = Path(sys.prefix)
    assert (venv / "bin" / "rlgateway").is_file(), f"run the tests from the venv ({venv})"
    busy = [p for p in PORTS if not _port_free(p)]
    assert not busy, f"the README's servers need ports {busy}: something else listens there"
    (tmp_path / ".venv").symlink_to(venv)
    (tmp_path / "configs").symlink_to(REPO_ROOT / "configs")
    runnable = [b for b in readme_blocks(README.read_text()) if b.tag == "run"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLGATEWAY_") or "VLLM" in k}
    env |= {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    log = tmp_path / "readme.log"  # a file: the servers the blocks start keep their output open
    with log.open("w") as sink:
        proc = subprocess.Popen(
            ["bash", "-c", script(runnable)],
            cwd=tmp_path,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        proc.wait(timeout=600)
        out = log.read_text(errors="replace")
        assert proc.returncode == 0, out[-6000:]
        assert out.rstrip().endswith("### done"), out[-6000:]
        check_what_it_left(tmp_path, out)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=20)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def check_what_it_left(root: Path, out: str) -> None:
    sessions = json.loads((root / "sessions.json").read_text())["sessions"]
    assert len(sessions) == 4
    for s in sessions:  # each agent's reply is printed after its session id
        assert re.search(rf"^{s['id']} ['\"]", out, re.M), out[-4000:]
    with sqlite3.connect(root / "rlgateway.db") as db:
        rows = db.execute(
            "SELECT s.id, s.ended_at IS NOT NULL, s.train_state, s.group_id FROM sessions s "
            "JOIN runs r ON r.id = s.run_id WHERE r.name = 'first'"
        ).fetchall()
        steps = db.execute("SELECT step, version FROM train_steps").fetchall()
    assert sorted(r[0] for r in rows) == sorted(s["id"] for s in sessions)
    assert all(
        ended and state == "consumed" and group == "prompt-1" for _, ended, state, group in rows
    )
    assert (1, 1) in [tuple(x) for x in steps], "the separate trainer's one step, as version 1"
    assert re.search(r'"version":\s*1\b', out), "the gateway served the trained policy"
    policy = json.loads((root / "trained-model" / "rlgateway_policy.json").read_text())
    assert policy["version"] == 1
    assert (root / "trained-model" / "config.json").is_file()
    lines = (root / "run.jsonl").read_text().splitlines()
    assert len(lines) == 4, "the export of the ended, rewarded sessions"
    assert "training run" in out, "serve --train printed the run it trains"
    assert (root / "tiny" / "config.json").is_file()
    samples = [json.loads(x) for x in out.splitlines() if x.startswith('{"text"')]
    assert len(samples) == 4, "generate -n 4 --json"
