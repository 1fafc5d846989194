"""`rlgateway launch SPEC --ray ADDRESS`: the whole topology on a Ray cluster, supervised.

Bring-up, in order, each part a `ProcessHost` actor placed by the spec's Ray resources:
1. the engine servers (if the spec has `engines`), `per_gateway` for each replica, healthy;
2. the gateway replicas, each on its own servers (or its local engine), all on the one
   PostgreSQL database, healthy (a replica is healthy once it serves the newest policy);
3. the run: the newest run of the spec's `name` that is not stopped, else a new one
   (`POST /runs` with `trainer.config`), so that launching the spec again trains on;
4. the trainer: a placement group of `trainer.nnodes` bundles, one torchrun per bundle
   (rank 0's node is the rendezvous), publishing to the first replica.

Supervision: every part is polled; a part whose process exited, or whose actor died (killed, or
its node lost), is restarted (up to `restarts` times each) on the node it was on when that node
is still there, at the same port when it is free, so that the gateways' engine URLs and the
trainer's gateway URL stay right (a server that comes back elsewhere has its replica restarted
on the new URL). A restarted server is re-synced to the current weights by its replica's router;
a restarted replica loads the newest published policy before it is healthy; a restarted trainer
(all its ranks together) resumes from its newest checkpoint. The launch ends when the trainer
finishes (`max_steps`), on SIGINT/SIGTERM, or when a part runs out of restarts; every process is
stopped and every actor and the placement group are removed whichever way it ends.

`WORK_DIR/launch.json` says where everything runs (URLs, nodes, process ids, logs, restarts),
rewritten after every (re)start.

Why torchrun in a placement group rather than Ray Train's `TorchTrainer`: the trainer is the same
program however it is deployed (`rlgateway train`, whose parallel runs are tested against one
process under torchrun), it resumes from its own checkpoints, and its ranks need nothing from Ray
but a place to run; `TorchTrainer` would run the training loop inside Ray's workers with its own
process-group setup, checkpointing and restart policy, a second trainer to keep equal to the first.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import httpx

from rlgateway.errors import CLIError
from rlgateway.launch.host import HostInfo, ProcessHost
from rlgateway.launch.spec import LaunchSpec, Resources
from rlgateway.launch.topology import Command, engine_command, gateway_command, trainer_command

POLL_S = 1.0
STARTUP_S = 900.0
"""How long a part may take to be placed and become healthy (a vLLM server loading a model)."""
STATE_FILE = "launch.json"


class LaunchError(CLIError):
    pass


class Stopped(Exception):
    """SIGINT or SIGTERM reached the launcher."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass
class Part:
    """One supervised process: `command(ip, port)` says what it runs once placed."""

    name: str
    role: str
    resources: Resources
    command: Callable[[str, int], Command]
    health: bool
    """Healthy means `GET /health` answers 200 (else: its process runs)."""
    port: int = 0
    strategy: Any = None
    actor: Any = None
    ip: str = ""
    node_id: str = ""
    info: HostInfo | None = None
    restarts: int = 0
    history: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://{self.ip}:{self.port}"


class _RayHost(ProcessHost):
    def node_id(self) -> str:
        import ray

        return str(ray.get_runtime_context().get_node_id())


def _reachable(address: str) -> None:
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=10).close()
    except (OSError, ValueError) as exc:
        raise LaunchError(
            f"no Ray cluster at {address!r} ({exc}): give its head's HOST:PORT (`ray start "
            "--head` prints it), `auto`, or `local`"
        ) from None


def _actor_options(resources: Resources) -> dict[str, Any]:
    custom = {k: v for k, v in resources.items() if k not in ("CPU", "GPU")}
    return {
        "num_cpus": resources.get("CPU", 0),
        "num_gpus": resources.get("GPU", 0),
        "resources": custom,
        "max_restarts": 0,  # the launcher restarts parts itself, where it can keep their address
        "max_concurrency": 1,
        # A worker that exits cleanly (its owner, the launcher, died; `ray.kill`) SIGKILLs its
        # direct children: the leader, which would leave its process group running. Without
        # that, the leader outlives the worker by a moment and takes its group down.
        "runtime_env": {"env_vars": {"RAY_kill_child_processes_on_worker_exit": "false"}},
    }


class RayLaunch:
    def __init__(
        self, spec: LaunchSpec, address: str, admin_token: str, out: Callable[[str], None] = print
    ) -> None:
        self.spec = spec
        self.address = address
        self.token = admin_token
        self.out = out
        self.work_dir = Path(spec.work_dir).resolve()
        self.engines: list[list[Part]] = []
        self.gateways: list[Part] = []
        self.ranks: list[Part] = []
        self.run_id = ""
        self.trainer_restarts = 0
        self._pg: Any = None
        self._signal: int | None = None

    # -- the whole launch ----------------------------------------------------------------------

    def run(self) -> int:
        import ray

        address = None if self.address == "local" else self.address
        if address not in (None, "auto"):
            _reachable(address)  # Ray itself would retry an unreachable head for minutes
        try:
            ray.init(address=address, logging_level=logging.WARNING)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise LaunchError(f"no Ray cluster at {self.address!r}: {exc}") from None
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        try:
            self._bring_up()
            return self._supervise()
        except Stopped as stop:
            self.out(f"{stop}: stopping everything")
            return 128 + stop.signum
        finally:
            self._tear_down()
            ray.shutdown()

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self._signal = signum

    def _check_signal(self) -> None:
        if self._signal is not None:
            raise Stopped(self._signal)

    def _bring_up(self) -> None:
        spec = self.spec
        self.work_dir.mkdir(parents=True, exist_ok=True)
        if spec.engines is not None:
            for g in range(spec.gateways.replicas):
                row = [
                    Part(f"engine-{g}-{e}", "engine", spec.engines.resources,
                         lambda ip, port: engine_command(spec, port), health=True)
                    for e in range(spec.engines.per_gateway)
                ]  # fmt: skip
                self.engines.append(row)
            self._start_all([p for row in self.engines for p in row])
        for g in range(spec.gateways.replicas):
            self.gateways.append(
                Part(f"gateway-{g}", "gateway", spec.gateways.resources,
                     self._gateway_command(g), health=True, port=spec.gateways.port)
            )  # fmt: skip
        self._start_all(self.gateways)
        self.run_id = self._find_or_create_run()
        self.out(f"training run ID {self.run_id} ({spec.name})")
        self._start_trainer()

    def _gateway_command(self, g: int) -> Callable[[str, int], Command]:
        def command(ip: str, port: int) -> Command:
            urls = [e.url for e in self.engines[g]] if self.engines else []
            return gateway_command(self.spec, ip, port, urls, self.token)

        return command

    # -- parts ---------------------------------------------------------------------------------

    def _start_all(self, parts: list[Part]) -> None:
        self._place(parts)
        for part in parts:
            self._wait_ready(part)
        self._save_state()

    def _place(self, parts: list[Part], near: str = "") -> None:
        """Create the parts' actors at once, learn where each landed, then start their commands
        in order (rank 0's address is the other trainer nodes' rendezvous)."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        actors: list[Any] = []
        for part in parts:
            options = _actor_options(part.resources)
            if part.strategy is not None:
                options["scheduling_strategy"] = part.strategy
            elif near:  # back where it was, when that node is still there
                options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(near, soft=True)
            actors.append(ray.remote(_RayHost).options(**options).remote(part.name))
        reserved = [a.reserve.remote(p.port) for p, a in zip(parts, actors, strict=True)]
        for part, actor, ref in zip(parts, actors, reserved, strict=True):
            part.ip, part.port = self._get(ref, part, "placed")
            part.actor = actor
        started = []
        for part in parts:
            cmd = part.command(part.ip, part.port)
            call = part.actor.start.remote(
                cmd.argv, cmd.env, files=cmd.files, unset=cmd.unset, model=cmd.model
            )
            started.append((call, part.actor.node_id.remote()))
        for part, (call, node) in zip(parts, started, strict=True):
            part.info = self._get(call, part, "started")
            part.node_id = self._get(node, part, "started")
            self.out(f"{part.name} on {part.ip} (node {part.node_id[:8]}), pid {part.info.pid}")

    def _get(self, ref: Any, part: Part, what: str) -> Any:
        import ray

        deadline = time.monotonic() + STARTUP_S
        while True:
            self._check_signal()
            try:
                return ray.get(ref, timeout=1.0)
            except ray.exceptions.GetTimeoutError:
                if time.monotonic() > deadline:
                    raise LaunchError(
                        f"{part.name} was not {what} within {STARTUP_S:.0f} s: does a node have "
                        f"the resources {part.resources}? (ray status)"
                    ) from None

    def _wait_ready(self, part: Part) -> None:
        deadline = time.monotonic() + STARTUP_S
        while True:
            state = self._poll(part)
            if state != "running":
                raise LaunchError(f"{part.name} {state} while starting:\n{self._tail(part)}")
            if not part.health or self._healthy(part):
                break
            if time.monotonic() > deadline:
                raise LaunchError(f"{part.name} not healthy in {STARTUP_S:.0f} s")
            self._check_signal()
            time.sleep(0.5)
        if part.health:
            self.out(f"{part.name} ready at {part.url}")

    @staticmethod
    def _healthy(part: Part) -> bool:
        try:
            return httpx.get(f"{part.url}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def _poll(self, part: Part) -> str:
        """'running', 'exited N', or 'lost' (its actor died)."""
        import ray

        try:
            code = ray.get(part.actor.poll.remote(), timeout=30)
        except ray.exceptions.GetTimeoutError:
            return "running"  # a busy node; the next look decides
        except ray.exceptions.RayActorError:
            return "lost"
        return "running" if code is None else f"exited {code}"

    def _tail(self, part: Part) -> str:
        import ray

        try:
            tail: str = ray.get(part.actor.log_tail.remote(), timeout=10)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            return f"(no log: its actor is gone; it was {part.info.log if part.info else '?'})"
        return tail

    def _stop(self, part: Part) -> None:
        import ray

        if part.actor is None:
            return
        # an actor that is gone took its processes with it (rlgateway.launch.leader)
        with contextlib.suppress(ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            ray.get(part.actor.stop.remote(), timeout=60)
        ray.kill(part.actor)
        part.actor = None

    def _restart(self, part: Part, why: str) -> None:
        part.restarts += 1
        part.history.append(why)
        if part.restarts > self.spec.restarts:
            raise LaunchError(
                f"{part.name} {why} and has no restart left ({self.spec.restarts}):\n"
                f"{self._tail(part)}"
            )
        self.out(f"{part.name} {why}: restarting it ({part.restarts} of {self.spec.restarts})")
        old_url, near = part.url, part.node_id
        self._stop(part)
        self._place([part], near=near)
        self._wait_ready(part)
        if part.role == "engine" and part.url != old_url:
            g = next(i for i, row in enumerate(self.engines) if part in row)
            self._restart(self.gateways[g], f"has a new engine URL ({part.url})")
        self._save_state()

    # -- the run and the trainer ---------------------------------------------------------------

    def _admin(self) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.token}"}
        return httpx.Client(base_url=self.gateways[0].url, headers=headers, timeout=60)

    def _find_or_create_run(self) -> str:
        with self._admin() as admin:
            r = admin.get("/runs")
            r.raise_for_status()
            mine = [x for x in r.json()["runs"] if x["name"] == self.spec.name]
            live = [x for x in mine if x["status"] != "stopped"]
            if live:  # newest first
                run_id: str = live[0]["id"]
                return run_id
            r = admin.post(
                "/runs", json={"name": self.spec.name, "config": self.spec.trainer.config}
            )
            if r.status_code != 201:
                raise LaunchError(f"the gateway refused the run: {r.status_code} {r.text}")
            created: str = r.json()["id"]
            return created

    def _start_trainer(self) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        t = self.spec.trainer
        if self._pg is None:
            bundle = {k: v for k, v in t.resources.items() if v}
            strategy = "STRICT_SPREAD" if t.nnodes > 1 else "PACK"
            self._pg = placement_group([dict(bundle) for _ in range(t.nnodes)], strategy=strategy)
            probe = Part("trainer", "trainer", t.resources, lambda ip, port: Command([]), False)
            self._get(self._pg.ready(), probe, "placed (its placement group)")
        master: list[tuple[str, int]] = []
        self.ranks = []
        for rank in range(t.nnodes):

            def command(ip: str, port: int, rank: int = rank) -> Command:
                if rank == 0:
                    master.append((ip, port))
                return trainer_command(
                    self.spec, run_id=self.run_id, node_rank=rank, master=master[0],
                    gateway_url=self.gateways[0].url, admin_token=self.token,
                )  # fmt: skip

            part = Part(f"trainer-{rank}", "trainer", t.resources, command, health=False)
            part.strategy = PlacementGroupSchedulingStrategy(
                self._pg, placement_group_bundle_index=rank
            )
            self.ranks.append(part)
        self._place(self.ranks)
        self._save_state()

    def _supervise(self) -> int:
        while True:
            self._check_signal()
            for part in [p for row in self.engines for p in row] + self.gateways:
                state = self._poll(part)
                if state != "running":
                    self._restart(part, state)
            states = [self._poll(r) for r in self.ranks]
            if all(s == "exited 0" for s in states):
                self.out(f"the trainer finished run {self.run_id}")
                return 0
            failed = [
                f"{r.name} {s}"
                for r, s in zip(self.ranks, states, strict=True)
                if s not in ("running", "exited 0")
            ]
            if failed:
                self.trainer_restarts += 1
                if self.trainer_restarts > self.spec.restarts:
                    raise LaunchError(
                        f"the trainer failed ({', '.join(failed)}) and has no restart left:\n"
                        f"{self._tail(self.ranks[0])}"
                    )
                self.out(
                    f"the trainer failed ({', '.join(failed)}): restarting it from its newest "
                    f"checkpoint ({self.trainer_restarts} of {self.spec.restarts})"
                )
                for r in self.ranks:
                    self._stop(r)
                self._start_trainer()
            time.sleep(POLL_S)

    # -- the end -------------------------------------------------------------------------------

    def _tear_down(self) -> None:
        from ray.util.placement_group import remove_placement_group

        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut this short
        for part in [*self.ranks, *self.gateways, *[p for row in self.engines for p in row]]:
            self._stop(part)
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None
        self._save_state(stopped=True)
        self.out("every part is stopped")

    def _save_state(self, *, stopped: bool = False) -> None:
        def row(p: Part) -> dict[str, Any]:
            info = asdict(p.info) if p.info else {}
            return {"name": p.name, "url": p.url if p.health else None, "node_id": p.node_id,
                    "restarts": p.restarts, "history": p.history, **info}  # fmt: skip

        state = {
            "run_id": self.run_id,
            "stopped": stopped,
            "gateways": [row(p) for p in self.gateways],
            "engines": [row(p) for r in self.engines for p in r],
            "trainer": [row(p) for p in self.ranks],
            "trainer_restarts": self.trainer_restarts,
        }
        tmp = self.work_dir / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        tmp.replace(self.work_dir / STATE_FILE)


def launch(spec: LaunchSpec, address: str, admin_token: str) -> int:
    def out(line: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {line}", flush=True)

    try:
        import ray  # noqa: F401
    except ImportError:
        raise CLIError("rlgateway launch --ray needs Ray: pip install 'rlgateway[ray]'") from None
    return RayLaunch(spec, address, admin_token, out).run()
