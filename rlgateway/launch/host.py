"""`ProcessHost`: one process of the topology (an engine server, a gateway replica, a trainer
node's torchrun) on a Ray node, as a Ray actor.

The launcher creates the actor where the spec's resources put it, asks it for its node's address
and a port (`reserve`: the one the part had before a restart, when it is still free), then starts
the command (`start`). The command runs under `rlgateway.launch.leader`, in a process group of
its own that dies with the actor: an actor that Ray kills, or whose process is killed, leaves no
process behind. `poll` says whether the command still runs; `stop` ends it (SIGTERM to the
group, SIGKILL after a grace period).

The class is plain Python; `rlgateway.launch.ray_launcher` makes it a Ray actor, so that this
module (and the unit tests of it) need no Ray.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from engines.launch import free_port


@dataclass(frozen=True, slots=True)
class HostInfo:
    """Where a part runs: its node, the actor's process and the command's (leader's) process."""

    node_ip: str
    actor_pid: int
    pid: int
    log: str


def node_ip() -> str:
    """This node's address as other nodes reach it (the interface of the default route)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the interface
            ip: str = sock.getsockname()[0]
        except OSError:
            ip = "127.0.0.1"
    return ip


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


class ProcessHost:
    def __init__(self, name: str) -> None:
        self.name = name
        self.dir = Path(tempfile.mkdtemp(prefix=f"rlgateway-{name}-"))
        self.proc: subprocess.Popen[bytes] | None = None

    def reserve(self, preferred: int = 0, wait_s: float = 30.0) -> tuple[str, int]:
        """(this node's address, a port): `preferred` once it is free (a restarted part's old
        port, which its killed predecessor may hold for a moment), else any free port."""
        deadline = time.monotonic() + wait_s
        while preferred:
            if port_free(preferred):
                return node_ip(), preferred
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
        return node_ip(), free_port("0.0.0.0")

    def start(
        self,
        argv: list[str],
        env: dict[str, str],
        *,
        files: dict[str, str] | None = None,
        unset: tuple[str, ...] = (),
        model: str | None = None,
    ) -> HostInfo:
        """Start `argv` with `env` added to the node's environment (`unset` taken out of it).
        `files` are written first into this part's folder. In `argv` and `env`, `{dir}` is that
        folder, `{python}` this node's interpreter, `{model}` the directory of `model` on this
        node (`rlgateway.models.resolve_model`: `tiny` and `smollm2` are built here, by the
        leader before it starts the command, so that this call returns at once)."""
        assert self.proc is None, "started once"
        for rel, text in (files or {}).items():
            (self.dir / rel).write_text(text)
        values = {"{dir}": str(self.dir), "{python}": sys.executable}

        def fill(text: str) -> str:
            for key, value in values.items():
                text = text.replace(key, value)
            return text

        argv = [fill(a) for a in argv]
        full_env = {k: v for k, v in os.environ.items() if k not in unset}
        full_env |= {k: fill(v) for k, v in env.items()}
        full_env["RLGATEWAY_LEADER_PARENT"] = str(os.getpid())
        leader = ["--model", model] if model is not None else []
        log = self.dir / "output.log"
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rlgateway.launch.leader", *leader, "--", *argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=full_env,
                cwd=self.dir,
                start_new_session=True,
            )
        return HostInfo(node_ip(), os.getpid(), self.proc.pid, str(log))

    def poll(self) -> int | None:
        """None while the command runs, else its exit status."""
        return None if self.proc is None else self.proc.poll()

    def log_tail(self, lines: int = 40) -> str:
        log = self.dir / "output.log"
        if not log.is_file():
            return ""
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, grace_s: float = 20.0) -> int | None:
        """SIGTERM to the leader (which stops its group), SIGKILL to the group after
        `grace_s`; returns the exit status."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(grace_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()
