"""`whole` responses, `total` deadlines and `pipe` consumers (the fleet's hot path uses all three)."""

from __future__ import annotations

import asyncio

import pytest

from shmdisagg.upstream import UpstreamDisconnected, UpstreamPool, UpstreamTimeout
from shmdisagg.upstream._connection import MAX_HEAD_BYTES
from tests.unit.upstream._server import Request, ScriptedServer, chunk, chunked_head, echo, until
from tests.unit.upstream.conftest import Run

HOST = "127.0.0.1"


def test_whole_returns_with_the_body_and_pools_the_connection(run: Run[None]) -> None:
    async def main() -> None:
        async with ScriptedServer(echo) as srv, UpstreamPool() as pool:
            resp = await pool.request(HOST, srv.port, "POST", "/x", b"hello", whole=True)
            assert resp.status == 200 and resp.body() == b"/x|hello"
            assert resp.body() == b""  # consumed
            assert pool.idle_count(HOST, srv.port) == 1

    run(main())


def test_whole_waits_for_a_body_sent_in_pieces(run: Run[None]) -> None:
    release = asyncio.Event()

    async def handler(req: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(chunked_head() + chunk(b"a"))
        await writer.drain()
        await release.wait()
        writer.write(chunk(b"b") + chunk(b""))
        await writer.drain()

    async def main() -> None:
        async with ScriptedServer(handler) as srv, UpstreamPool() as pool:
            task = asyncio.ensure_future(pool.request(HOST, srv.port, "POST", "/", b"", whole=True))
            await asyncio.sleep(0.05)
            assert not task.done()  # the head came, the body did not end
            release.set()
            assert (await task).body() == b"ab"

    run(main())


def test_body_of_a_response_still_arriving_is_refused(run: Run[None]) -> None:
    async def handler(req: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(chunked_head() + chunk(b"a"))
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(chunk(b""))
        await writer.drain()

    async def main() -> None:
        async with ScriptedServer(handler) as srv, UpstreamPool() as pool:
            resp = await pool.request(HOST, srv.port, "POST", "/", b"")
            with pytest.raises(RuntimeError, match="still arriving"):
                resp.body()
            assert await resp.read() == b"a"

    run(main())


@pytest.mark.parametrize("whole", [True, False])
def test_total_deadline_bounds_the_body(run: Run[None], whole: bool) -> None:
    async def handler(req: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(chunked_head() + chunk(b"early"))
        await writer.drain()
        await asyncio.sleep(5)
        return False

    async def main() -> None:
        async with ScriptedServer(handler) as srv, UpstreamPool() as pool:
            if whole:
                with pytest.raises(UpstreamTimeout, match="did not complete"):
                    await pool.request(HOST, srv.port, "POST", "/", b"", timeout_s=0.1, whole=True)
            else:
                resp = await pool.request(HOST, srv.port, "POST", "/", b"", timeout_s=0.1, total=True)
                assert await resp.__anext__() == b"early"
                with pytest.raises(UpstreamTimeout, match="did not complete"):
                    await resp.__anext__()
            await until(lambda: pool.open_count == 0, "timed-out connection is lost")

    run(main())


def test_total_deadline_does_not_outlive_the_response(run: Run[None]) -> None:
    async def main() -> None:
        async with ScriptedServer(echo) as srv, UpstreamPool(idle_timeout_s=5) as pool:
            resp = await pool.request(HOST, srv.port, "POST", "/", b"one", timeout_s=0.05, total=True)
            assert await resp.read() == b"/|one"
            await asyncio.sleep(0.1)  # past the first deadline: the pooled connection is unharmed
            resp = await pool.request(HOST, srv.port, "POST", "/", b"two", whole=True)
            assert resp.body() == b"/|two" and pool.connects == 1

    run(main())


def test_pipe_hands_over_every_piece_then_pools(run: Run[None]) -> None:
    release = asyncio.Event()

    async def handler(req: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(chunked_head() + chunk(b"a"))
        await writer.drain()
        await release.wait()
        for piece in (b"b", b"c"):
            writer.write(chunk(piece))
            await writer.drain()
        writer.write(chunk(b""))
        await writer.drain()

    async def main() -> None:
        got: list[bytes] = []
        async with ScriptedServer(handler) as srv, UpstreamPool() as pool:
            resp = await pool.request(HOST, srv.port, "POST", "/", b"")
            await until(lambda: resp._conn is not None and resp._conn.buffered > 0, "the first piece buffered")
            task = asyncio.ensure_future(resp.pipe(got.append))
            await until(lambda: got == [b"a"], "the buffered piece handed over at once")
            release.set()
            await task
            assert b"".join(got) == b"abc"
            assert pool.idle_count(HOST, srv.port) == 1

    run(main())


def test_pipe_fails_with_the_sinks_exception_and_drops_the_connection(run: Run[None]) -> None:
    async def handler(req: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(chunked_head())
        await writer.drain()
        await asyncio.sleep(0.02)
        writer.write(chunk(b"bad") + chunk(b""))
        await writer.drain()

    def sink(data: bytes) -> None:
        raise ValueError("refused " + data.decode())

    async def main() -> None:
        async with ScriptedServer(handler) as srv, UpstreamPool() as pool:
            resp = await pool.request(HOST, srv.port, "POST", "/", b"")
            with pytest.raises(ValueError, match="refused bad"):
                await resp.pipe(sink)
            await until(lambda: pool.open_count == 0, "the connection dropped")
            assert pool.idle_count(HOST, srv.port) == 0

    run(main())


def test_pipe_raises_a_drop_mid_body(run: Run[None]) -> None:
    async def handler(req: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nxx")
        await writer.drain()
        await asyncio.sleep(0.02)
        return False

    async def main() -> None:
        got: list[bytes] = []
        async with ScriptedServer(handler) as srv, UpstreamPool() as pool:
            resp = await pool.request(HOST, srv.port, "POST", "/", b"")
            with pytest.raises(UpstreamDisconnected, match="mid-body"):
                await resp.pipe(got.append)
            assert b"".join(got) == b"xx"

    run(main())


def test_pause_and_resume_reading(run: Run[None]) -> None:
    async def main() -> None:
        async with ScriptedServer(echo) as srv, UpstreamPool() as pool:
            resp = await pool.request(HOST, srv.port, "POST", "/", b"x" * 10)
            resp.pause_reading()
            assert resp._conn is not None and resp._conn.paused
            resp.resume_reading()
            assert not resp._conn.paused
            assert await resp.read() == b"/|" + b"x" * 10

    run(main())


def test_whole_takes_a_body_larger_than_the_head_limit(run: Run[None]) -> None:
    """The head's size limit stops at the head, though a `whole` request waits on past it."""
    big = b"x" * (3 * MAX_HEAD_BYTES)

    async def handler(req: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(chunked_head() + chunk(big[: MAX_HEAD_BYTES * 2]))
        await writer.drain()
        await asyncio.sleep(0.02)
        writer.write(chunk(big[MAX_HEAD_BYTES * 2 :]) + chunk(b""))
        await writer.drain()

    async def main() -> None:
        async with ScriptedServer(handler) as srv, UpstreamPool() as pool:
            resp = await pool.request(HOST, srv.port, "POST", "/", b"", whole=True)
            assert resp.body() == big

    run(main())
