"""How the gateway's HTTP server treats connections, beyond what uvicorn does itself.

uvicorn times out a kept-alive connection only after a response, and any byte a client sends
cancels that timer; a connection that never completes its request head is never timed out. One
client trickling header bytes can so hold a connection (and, repeated, every file descriptor)
forever. `header_deadline(seconds)` is uvicorn's HTTP protocol with a deadline on every request
head: from the moment the connection opens or a response completes, the next request's headers
must be complete within `seconds`, or the connection is closed. `EmbeddedServer` is uvicorn's
server for a program that serves the gateway as one of its parts and keeps its signals.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Generator
from typing import Any

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol


def header_deadline(seconds: float) -> type[asyncio.Protocol]:
    """uvicorn's (auto-chosen) HTTP protocol class, with `seconds` for each request head. Pass it
    as `uvicorn.run(..., http=...)`."""

    class HeaderDeadline(AutoHTTPProtocol):  # type: ignore[misc,valid-type]
        _deadline: asyncio.TimerHandle | None = None
        _armed_for: Any = None

        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            # the request under way when armed: a later head starts a new cycle
            self._armed_for = self.cycle
            self._deadline = self.loop.call_later(seconds, self._expire)

        def _expire(self) -> None:
            self._deadline = None
            if self.cycle is self._armed_for and not self.transport.is_closing():
                self.transport.close()  # no request head within the deadline

    return HeaderDeadline


class EmbeddedServer(uvicorn.Server):
    """A uvicorn server inside a program that owns its signals (`rlgateway run`, the demo).

    `uvicorn.Server.serve` takes SIGINT and SIGTERM for itself: Ctrl-C would shut the gateway
    down while the program's rollouts and trainer go on against it, and reach the program only
    after the server stopped. This server leaves signals alone; the program stops it (setting
    `should_exit`) as it stops everything else."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield
