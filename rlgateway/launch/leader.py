"""`python -m rlgateway.launch.leader [--model NAME] -- ARGV...`: run ARGV and take everything it
starts down with it, so that no process outlives the Ray actor that hosts it.

With `--model`, `{model}` in ARGV is first replaced by NAME's directory on this node
(`python -m rlgateway.models NAME`: `tiny` and `smollm2` are built here on first use), in a
process of its own so that the leader stays small.

The leader is started in a session of its own by `rlgateway.launch.host.ProcessHost`; ARGV and
whatever it starts (a gateway's engine process, torchrun's ranks, vLLM's engine core) stay in
the leader's process group. The kernel sends the leader SIGTERM when the actor's process dies
(`PR_SET_PDEATHSIG`: an actor killed by Ray, by a node's failure, or with SIGKILL), as its
host does to stop it; the leader then sends SIGTERM to the group, waits `GRACE_S`, and kills
what is left. When ARGV exits by itself, what it left behind in the group is killed, and the
leader exits with ARGV's status.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

GRACE_S = 15.0
PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def _group_members() -> list[int]:
    """The other processes of this process's group (read from /proc)."""
    me, group = os.getpid(), os.getpgid(0)
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            # field 5 of stat is the process group; the name (field 2) may hold spaces
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group:
            out.append(int(entry.name))
    return out


def _kill_members(sig: signal.Signals) -> None:
    for pid in _group_members():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _model_dir(name: str) -> str:
    cmd = [sys.executable, "-m", "rlgateway.models", name]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"leader: no model {name!r} on this node (exit {done.returncode})")
    return done.stdout.strip().splitlines()[-1]


def main(argv: list[str]) -> int:
    model = None
    if argv[:1] == ["--model"] and len(argv) > 1:
        model, argv = argv[1], argv[2:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print(
            "usage: python -m rlgateway.launch.leader [--model NAME] -- COMMAND [ARGS...]",
            file=sys.stderr,
        )
        return 2
    parent = int(os.environ.pop("RLGATEWAY_LEADER_PARENT", os.getppid()))
    stopping: list[int] = []

    def stop(signum: int, _frame: FrameType | None) -> None:
        stopping.append(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    _die_with_parent(parent)
    if model is not None:
        path = _model_dir(model)
        argv = [a.replace("{model}", path) for a in argv]
    if stopping:
        return 128 + stopping[0]
    child = subprocess.Popen(argv)
    deadline: float | None = None
    while True:
        code = child.poll()
        if code is not None:
            break
        if stopping and deadline is None:
            _kill_members(signal.SIGTERM)
            deadline = time.monotonic() + GRACE_S
        if deadline is not None and time.monotonic() > deadline:
            _kill_members(signal.SIGKILL)
        time.sleep(0.05)
    _kill_members(signal.SIGKILL)  # what the command left behind
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
