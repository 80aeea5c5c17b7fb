"""Backpressure: a consumer of `async for` that falls behind pauses reading from the executor."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from shmdisagg.upstream import UpstreamPool
from tests.unit.upstream._server import Request, ScriptedServer, chunk, chunked_head, until
from tests.unit.upstream.conftest import Run

HOST = "127.0.0.1"
PIECE = b"s" * (256 << 10)
# Far more than loopback socket buffers can hold (tcp_rmem max is often 32 MiB), so a client
# that kept reading would hold most of it in memory, and a paused one leaves the server blocked.
TOTAL = 96 << 20


class RecordingTransport:
    """Wraps the client's transport; counts resume_reading calls and forwards everything else."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.resumes = 0

    def resume_reading(self) -> None:
        self.resumes += 1
        self.inner.resume_reading()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_slow_consumer_pauses_reading_until_it_catches_up(run: Run[None]) -> None:
    async def main() -> None:
        server_done = asyncio.Event()

        async def handler(req: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
            writer.write(chunked_head())
            for _ in range(TOTAL // len(PIECE)):
                writer.write(chunk(PIECE))
                await writer.drain()
            writer.write(chunk(b""))
            await writer.drain()
            server_done.set()

        high_water = 64 << 10
        async with ScriptedServer(handler) as srv, UpstreamPool(read_high_water_bytes=high_water) as pool:
            resp = await pool.request(HOST, srv.port, "GET", "/stream")
            conn = resp._conn
            assert conn is not None
            # Nobody consumes, so the client must stop reading (it may have already).
            await until(lambda: conn.paused, "the client paused reading")
            assert conn.transport is not None
            assert not conn.transport.is_reading()
            recorder = RecordingTransport(conn.transport)
            conn.transport = recorder  # type: ignore[assignment]
            held = conn.buffered
            assert high_water < held <= high_water + (1 << 20)  # one socket read past the mark at most
            received = conn.body_total
            await asyncio.sleep(0.05)  # checking that nothing more is read while paused
            assert conn.body_total == received
            assert not server_done.is_set()  # the executor is held back, not buffered in the client

            total = 0
            async for data in resp:
                total += len(data)
                assert conn.buffered <= high_water + (1 << 20)
            assert total == TOTAL
            assert recorder.resumes > 0
            assert server_done.is_set()
            assert pool.idle_count(HOST, srv.port) == 1

    run(main())


def test_read_collects_a_body_larger_than_the_high_water_mark(run: Run[None]) -> None:
    body = b"r" * (3 << 20)

    async def handler(req: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(chunked_head() + chunk(body) + chunk(b""))
        await writer.drain()

    async def main() -> None:
        async with ScriptedServer(handler) as srv, UpstreamPool(read_high_water_bytes=1024) as pool:
            resp = await pool.request(HOST, srv.port, "GET", "/")
            assert await resp.read() == body
            assert pool.idle_count(HOST, srv.port) == 1

    run(main())
