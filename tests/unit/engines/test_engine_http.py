"""`engines.http.EngineHTTP` against a raw HTTP/1.1 server on a loopback port that tells how each
request arrived: connections are kept and reused once a body is read to its end (also in the
background after a caller left at [DONE]), an abort closes one, a kept-alive connection that the
server drops before answering is retried once on a new one, server-sent events split on newlines
only, and every transport failure is `EngineUnavailableError`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from engines.errors import EngineUnavailableError
from engines.http import EngineHTTP


@dataclass
class RawServer:
    """Answers `/n` with a JSON body and `/sse` with chunked server-sent events; with
    `drop_second=True` it closes a connection, unanswered, when a second request arrives on it
    (what a server whose keep-alive timer just fired does)."""

    drop_second: bool = False
    hold_terminator: asyncio.Event | None = None
    """When set, a stream's last chunk (the chunked terminator) waits for this event."""
    connections: int = 0
    requests: list[tuple[int, str]] = field(default_factory=list)
    """(connection number, request line) in arrival order."""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        conn = self.connections
        served = 0
        try:
            while line := await reader.readline():
                length = 0
                while (header := await reader.readline()) not in (b"\r\n", b""):
                    name, _, value = header.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                await reader.readexactly(length)
                if self.drop_second and served == 1:
                    return  # closed, unanswered
                served += 1
                self.requests.append((conn, line.decode().strip()))
                if b" /n " in line:
                    body = json.dumps({"conn": conn}).encode()
                    head = f"HTTP/1.1 200 OK\r\ncontent-length: {len(body)}\r\n\r\n"
                    writer.write(head.encode() + body)
                else:
                    writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
                    # one event split across chunks, a U+2028 inside the JSON, then [DONE]
                    for part in (
                        b'data: {"t": "a\xe2\x80\xa8',
                        b'b"}\n\ndata: {"t": 2}\n\n',
                        b"data: [DONE]\n\n",
                    ):
                        writer.write(b"%x\r\n%s\r\n" % (len(part), part))
                        await writer.drain()
                    if self.hold_terminator is not None:
                        await self.hold_terminator.wait()
                    writer.write(b"0\r\n\r\n")
                await writer.drain()
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def serving(server: RawServer) -> AsyncIterator[str]:
    srv = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.close()


async def test_a_connection_is_reused_after_a_stream_read_to_its_end() -> None:
    server = RawServer()
    async with serving(server) as url:
        http = EngineHTTP(url)
        try:
            async with http.stream("/sse", {"x": 1}) as response:
                assert response.status == 200
                events = [e async for e in response.events()]
            reply = await http.get("/n")
        finally:
            await http.close()
    assert events == ['{"t": "a\u2028b"}', '{"t": 2}', "[DONE]"]
    assert json.loads(events[0])["t"] == "a\u2028b"
    assert reply.status == 200
    assert reply.json() == {"conn": 1}
    assert server.requests == [(1, "POST /sse HTTP/1.1"), (1, "GET /n HTTP/1.1")]


async def test_a_caller_that_leaves_at_done_is_not_kept_waiting_and_an_abort_closes() -> None:
    """Leaving at [DONE] returns at once; the rest of the body is read in the background and the
    connection is kept. Leaving by an exception (an abort) closes the connection."""
    server = RawServer(hold_terminator=asyncio.Event())
    async with serving(server) as url:
        http = EngineHTTP(url)
        try:
            async with http.stream("/sse", {}) as response:
                async for event in response.events():
                    if event == "[DONE]":
                        break
            # Out, though the server still holds the end of the body back.
            assert server.hold_terminator is not None
            server.hold_terminator.set()
            await asyncio.gather(*http._draining)
            assert (await http.post("/n")).json()["conn"] == 1  # kept

            async def abort_midway() -> None:
                async with http.stream("/sse", {}) as response:
                    async for _ in response.events():
                        raise RuntimeError("abort")

            server.hold_terminator = asyncio.Event()  # the body is unfinished at the abort
            with pytest.raises(RuntimeError):
                await abort_midway()
            assert (await http.post("/n")).json()["conn"] == 2  # closed by the abort
            server.hold_terminator.set()
        finally:
            await http.close()


async def test_closing_right_after_a_caller_left_at_done_leaves_no_response_open() -> None:
    """The background read of the body's rest may not have started when the client is closed
    (its task, cancelled before its first step, never runs): close still closes that response.
    Left open, its connection went to the garbage collector, which warned "Unclosed connection"
    in whatever test ran then (a CI failure once)."""
    server = RawServer(hold_terminator=asyncio.Event())
    async with serving(server) as url:
        http = EngineHTTP(url)
        async with http.stream("/sse", {}) as response:
            async for event in response.events():
                if event == "[DONE]":
                    break
        [left] = http._draining.values()  # the rest is still to read; its task has not run
        await http.close()
        assert left.closed
        assert left.connection is None
        assert server.hold_terminator is not None
        server.hold_terminator.set()


async def test_a_kept_connection_the_server_dropped_is_retried_on_a_new_one() -> None:
    """POSTs (aiohttp itself resends only idempotent methods) on two kept connections: each is
    dropped under its next request, which is sent again on a new connection, not on the other
    kept one (which would be dropped as well)."""
    server = RawServer(drop_second=True)
    async with serving(server) as url:
        http = EngineHTTP(url)
        try:
            first = await asyncio.gather(http.post("/n"), http.post("/n"))
            assert sorted(r.json()["conn"] for r in first) == [1, 2]
            assert (await http.post("/n")).json()["conn"] == 3
            async with http.stream("/sse", {}) as response:
                assert [e async for e in response.events()][-1] == "[DONE]"
        finally:
            await http.close()
    assert server.requests[2:] == [(3, "POST /n HTTP/1.1"), (4, "POST /sse HTTP/1.1")]
    assert server.connections == 4


async def test_an_unreachable_server_is_engine_unavailable() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, never listening: connections are refused
        http = EngineHTTP(f"http://127.0.0.1:{port}")
        try:
            with pytest.raises(EngineUnavailableError, match="unreachable"):
                await http.get("/n")
            with pytest.raises(EngineUnavailableError, match="unreachable"):
                async with http.stream("/sse", {}):
                    pass
        finally:
            await http.close()
