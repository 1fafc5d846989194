"""HAProxy (Debian's package) in front of gateway replicas, as a user puts their own.

`run_haproxy(port, servers, tmp_path)` balances each HTTP request round-robin over `servers`
(name -> port on 127.0.0.1), health-checks them on `GET /health` every 0.3 s, sends a request whose
connection could not be made to another replica (never one that reached a replica: the client
retries that, with its retry header), names the replica that answered in the
`X-Rlgateway-Replica` response header, and stops HAProxy on exit.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

REPLICA_HEADER = "X-Rlgateway-Replica"

_CONFIG = """\
global
    maxconn 4096
defaults
    mode http
    timeout connect 2s
    timeout client 300s
    timeout server 300s
    retries 3
    option redispatch
    # only a request that never reached a gateway is sent again: one replayed after a replica
    # died under it (empty-response) would reach another as a new request, not a retry
    retry-on conn-failure
frontend fleet
    bind 127.0.0.1:{port}
    default_backend gateways
    http-response set-header {header} %s
backend gateways
    balance roundrobin
    option httpchk GET /health
    http-check expect status 200
{servers}
"""


@contextmanager
def run_haproxy(port: int, servers: Mapping[str, int], tmp_path: Path) -> Iterator[str]:
    """HAProxy on 127.0.0.1:`port` in front of `servers`; yields its URL."""
    binary = shutil.which("haproxy") or next(
        (p for p in ("/usr/sbin/haproxy",) if Path(p).exists()), None
    )
    assert binary is not None, "haproxy is not installed: apt-get install haproxy (.ci/run does)"
    lines = [
        f"    server {name} 127.0.0.1:{p} check inter 300ms fall 2 rise 1"
        for name, p in servers.items()
    ]
    config = tmp_path / "haproxy.cfg"
    config.write_text(_CONFIG.format(port=port, header=REPLICA_HEADER, servers="\n".join(lines)))
    log = tmp_path / "haproxy.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([binary, "-db", "-f", str(config)], stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + 10
        while True:
            assert proc.poll() is None, log.read_text()
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
