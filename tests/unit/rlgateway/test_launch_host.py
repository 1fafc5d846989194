"""A part's process on its node (`rlgateway/launch/host.py`, `rlgateway/launch/leader.py`), with
real processes and no Ray: nothing it starts outlives it, whether the command exits by itself,
is stopped, or the process hosting it (a Ray actor) is killed."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlgateway.launch.host import ProcessHost
from tests.support.paths import REPO_ROOT
from tests.support.procs import group_members

# a command that leaves a grandchild behind in its process group, as a server leaves its engine
LEAVES_A_CHILD = ["sh", "-c", "sleep 300 & echo $! > child.pid; echo started; exit 3"]


def wait_gone(pgid: int, timeout: float = 20) -> bool:
    deadline = time.monotonic() + timeout
    while group_members(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def wait_exit(host: ProcessHost, timeout: float = 20) -> int:
    deadline = time.monotonic() + timeout
    while (code := host.poll()) is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return code


def test_the_commands_status_comes_back_and_what_it_left_behind_is_killed() -> None:
    host = ProcessHost("t")
    info = host.start(LEAVES_A_CHILD, {})
    assert wait_exit(host) == 3
    assert wait_gone(info.pid)
    assert "started" in host.log_tail()


def test_stop_ends_the_whole_group_and_files_and_placeholders_are_filled(tmp_path: Path) -> None:
    host = ProcessHost("t")
    argv = ["sh", "-c", 'cat "$0"; echo "$FROM_ENV"; exec sleep 300', "{dir}/in.txt"]
    info = host.start(argv, {"FROM_ENV": "{python}"}, files={"in.txt": "written\n"})
    deadline = time.monotonic() + 20
    while sys.executable not in host.log_tail():
        assert time.monotonic() < deadline, host.log_tail()
        time.sleep(0.05)
    assert host.log_tail().splitlines()[:2] == ["written", sys.executable]
    assert host.stop(grace_s=10) is not None
    assert wait_gone(info.pid)


def test_unset_takes_a_variable_out_of_the_nodes_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LAUNCH_SECRET", "x")
    host = ProcessHost("t")
    host.start(["sh", "-c", 'echo "[${LAUNCH_SECRET:-unset}]"'], {}, unset=("LAUNCH_SECRET",))
    assert wait_exit(host) == 0
    assert host.log_tail() == "[unset]"


def test_a_killed_host_takes_its_command_and_what_that_started_with_it(tmp_path: Path) -> None:
    script = (
        "import sys, time\n"
        "from rlgateway.launch.host import ProcessHost\n"
        "info = ProcessHost('t').start(sys.argv[1:], {})\n"
        "print(info.pid, flush=True)\n"
        "time.sleep(300)\n"
    )
    argv = ["sh", "-c", "sleep 300 & exec sleep 300"]
    with subprocess.Popen([sys.executable, "-c", script, *argv], stdout=subprocess.PIPE,
                          cwd=REPO_ROOT, text=True) as host:  # fmt: skip
        assert host.stdout is not None
        pgid = int(host.stdout.readline())
        deadline = time.monotonic() + 20
        while len(group_members(pgid)) < 3:  # the leader, the command and its child
            assert time.monotonic() < deadline, group_members(pgid)
            time.sleep(0.05)
        os.kill(host.pid, signal.SIGKILL)  # as Ray kills an actor, or a node takes it down
    assert wait_gone(pgid)


def test_a_restarted_part_gets_its_old_port_back_once_free_else_another() -> None:
    host = ProcessHost("t")
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        _, port = host.reserve(taken, wait_s=0.3)
        assert port != taken
    _, again = host.reserve(taken, wait_s=0.3)
    assert again == taken


def test_the_model_is_found_on_the_node_before_the_command_starts(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    host = ProcessHost("t")
    host.start(["sh", "-c", 'echo "$0"', "{model}"], {}, model=str(tmp_path))
    assert wait_exit(host) == 0
    assert host.log_tail() == str(tmp_path)
    missing = ProcessHost("t")
    missing.start(["true", "{model}"], {}, model=str(tmp_path / "nothing"))
    assert wait_exit(missing) != 0
    assert "is not smollm2, tiny, or a model directory" in missing.log_tail()
