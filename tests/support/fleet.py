"""A fleet for tests: `rlgateway serve` replicas on one fresh PostgreSQL database behind HAProxy.

`run_fleet(model_dir, factory)` starts replicas "a" and "b" (each its own engine process), on
ports chosen once so that a replica killed with SIGKILL (`Fleet.kill`) comes back at the same
address (`Fleet.restart`), and HAProxy in front (`tests/support/load_balancer.py`); new sessions'
`base_url` is the balancer's. The database is dropped at the end.

`Fleet.lb` sends a request again when its connection drops without an answer, as the openai SDK
does: HAProxy reuses idle connections to a replica, and one that died under a reused connection
makes HAProxy close the client's connection unanswered so that the client retries (as browsers
do). Every admin call the tests make through it is safe to repeat.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.store_fixtures import create_postgres_database, drop_postgres_database
from tests.support.gateway_server import GatewayHandle, free_port, run_gateway
from tests.support.load_balancer import REPLICA_HEADER, run_haproxy
from tests.support.procs import live_children

POLL = "0.3"
"""Seconds between a replica's looks for a policy another one loaded."""


@dataclass
class Fleet:
    url: str
    """The balancer's."""
    lb: httpx.Client
    """Admin client through the balancer."""
    replicas: dict[str, GatewayHandle]
    database_url: str
    env: dict[str, str]
    model_dir: Path
    factory: pytest.TempPathFactory
    _stack: ExitStack = field(repr=False)

    def version(self, name: str) -> int:
        version: int = self.replicas[name].client.get("/admin/version").json()["version"]
        return version

    def replica_of(self, response: httpx.Response) -> str:
        return response.headers[REPLICA_HEADER]

    def kill(self, name: str) -> None:
        """SIGKILL to the replica and its engine process; returns once they are gone and the
        balancer sends every request to the others."""
        pid = self.replicas[name].pid
        os.killpg(pid, signal.SIGKILL)
        wait_for(lambda: all(p != pid for p, _ in live_children(os.getpid())), f"{name} gone")
        wait_for(
            lambda: all(self.replica_of(self.lb.get("/health")) != name for _ in range(4)),
            f"the balancer leaves {name} out",
        )

    def restart(self, name: str, **env: str) -> GatewayHandle:
        """The killed replica started again at its address (until the fleet stops); returns once
        it is healthy, which it reports only after loading the newest published policy."""
        old = self.replicas[name]
        port = int(old.url.rsplit(":", 1)[1])
        handle = self._stack.enter_context(
            run_gateway(
                self.model_dir,
                self.factory.mktemp(f"replica-{name}"),
                port=port,
                database_url=self.database_url,
                extra_env={**self.env, **env},
            )
        )
        self.replicas[name] = handle
        return handle


class _Retrying(httpx.HTTPTransport):
    """A dropped connection or a refused one is tried again, up to ten times."""

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        for attempt in range(10):
            try:
                return super().handle_request(request)
            except httpx.TransportError:
                if attempt == 9:
                    raise
                time.sleep(0.2)
        raise AssertionError("unreachable")


def wait_for(done: object, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not done():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


@contextmanager
def run_fleet(model_dir: Path, factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    database_url = create_postgres_database()
    lb_port, ports = free_port(), {"a": free_port(), "b": free_port()}
    env = {
        "RLGATEWAY_PUBLIC_URL": f"http://127.0.0.1:{lb_port}",
        "RLGATEWAY_POLICY_POLL_SECONDS": POLL,
    }
    try:
        with ExitStack() as stack:
            replicas = {
                name: stack.enter_context(
                    run_gateway(
                        model_dir,
                        factory.mktemp(f"replica-{name}"),
                        port=port,
                        database_url=database_url,
                        extra_env=env,
                    )
                )
                for name, port in ports.items()
            }
            url = stack.enter_context(run_haproxy(lb_port, ports, factory.mktemp("lb")))
            lb = stack.enter_context(
                httpx.Client(
                    base_url=url,
                    headers={"Authorization": "Bearer test-admin"},
                    timeout=60,
                    transport=_Retrying(),
                )
            )
            yield Fleet(url, lb, replicas, database_url, env, model_dir, factory, stack)
    finally:
        drop_postgres_database(database_url)
