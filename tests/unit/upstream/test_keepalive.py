"""Connection reuse: LIFO idle stacks, idle timeout, Connection: close, the keep-alive race retry."""

from __future__ import annotations

import asyncio

import pytest

from shmdisagg.upstream import UpstreamConnectError, UpstreamDisconnected, UpstreamPool
from tests.unit.upstream._server import Request, ScriptedServer, echo, response, until
from tests.unit.upstream.conftest import Run

HOST = "127.0.0.1"


def test_sequential_requests_reuse_one_connection(run: Run[None]) -> None:
    async def main() -> None:
        async with ScriptedServer(echo) as srv, UpstreamPool() as pool:
            for i in range(10):
                resp = await pool.request(HOST, srv.port, "POST", f"/{i}", b"x")
                assert await resp.read() == f"/{i}|x".encode()
                assert pool.idle_count(HOST, srv.port) == 1
            assert srv.connections == 1
            assert pool.connects == 1
            assert [r.seq for r in srv.requests] == list(range(10))

    run(main())


def test_streamed_response_iterated_to_the_end_returns_its_connection(run: Run[None]) -> None:
    async def main() -> None:
        async with ScriptedServer(echo) as srv, UpstreamPool() as pool:
            for _ in range(3):
                resp = await pool.request(HOST, srv.port, "POST", "/", b"x")
                assert [c async for c in resp] == [b"/|x"]
            assert srv.connections == 1

    run(main())


def test_connection_close_response_is_not_pooled(run: Run[None]) -> None:
    async def handler(req: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(response(b"bye", headers=b"connection: close\r\n"))
        await writer.drain()
        return False

    async def main() -> None:
        async with ScriptedServer(handler) as srv, UpstreamPool() as pool:
            for _ in range(2):
                assert await (await pool.request(HOST, srv.port, "GET", "/")).read() == b"bye"
                assert pool.idle_count(HOST, srv.port) == 0
            assert srv.connections == 2
            assert pool.stale_retries == 0

    run(main())


@pytest.mark.parametrize("how", ["fin", "reset"])
def test_keepalive_race_is_retried_once_on_a_fresh_connection(run: Run[None], how: str) -> None:
    # The server drops a kept-alive connection just as the second request arrives on it, without
    # sending a byte: the classic keep-alive race. The client replays it on a new connection.
    async def handler(req: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool | None:
        if req.conn == 0 and req.seq == 1:
            if how == "reset":
                writer.transport.abort()
            return False
        await echo(req, reader, writer)
        return None

    async def main() -> None:
        async with ScriptedServer(handler) as srv, UpstreamPool() as pool:
            assert await (await pool.request(HOST, srv.port, "POST", "/a", b"1")).read() == b"/a|1"
            assert await (await pool.request(HOST, srv.port, "POST", "/b", b"2")).read() == b"/b|2"
            assert srv.connections == 2
            assert pool.stale_retries == 1
            assert [(r.conn, r.path) for r in srv.requests] == [(0, "/a"), (0, "/b"), (1, "/b")]

    run(main())


def test_server_closing_an_idle_connection_never_fails_the_next_request(run: Run[None]) -> None:
    # Whether the client saw the FIN while idle (connection dropped from the pool) or only when
    # it wrote (the race, retried), the next request succeeds on a new connection.
    async def handler(req: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        await echo(req, reader, writer)
        return False

    async def main() -> None:
        async with ScriptedServer(handler) as srv, UpstreamPool() as pool:
            for i in range(5):
                assert await (await pool.request(HOST, srv.port, "POST", f"/{i}", b"")).read() == f"/{i}|".encode()
            assert srv.connections == 5

    run(main())


def test_a_fresh_connection_closed_before_the_head_is_not_retried(run: Run[None]) -> None:
    async def handler(req: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        return False

    async def main() -> None:
        async with ScriptedServer(handler) as srv, UpstreamPool() as pool:
            with pytest.raises(UpstreamDisconnected) as info:
                await pool.request(HOST, srv.port, "POST", "/", b"x")
            assert info.value.bytes_received == 0
            assert srv.connections == 1
            assert pool.stale_retries == 0

    run(main())


def test_no_retry_once_a_response_byte_arrived(run: Run[None]) -> None:
    async def handler(req: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool | None:
        if req.seq == 1:
            writer.write(b"HTTP/1.1 200 OK\r\n")  # then drop the connection mid-head
            await writer.drain()
            return False
        await echo(req, reader, writer)
        return None

    async def main() -> None:
        async with ScriptedServer(handler) as srv, UpstreamPool() as pool:
            await (await pool.request(HOST, srv.port, "POST", "/", b"x")).read()
            with pytest.raises(UpstreamDisconnected) as info:
                await pool.request(HOST, srv.port, "POST", "/", b"x")
            assert info.value.bytes_received == len(b"HTTP/1.1 200 OK\r\n")
            assert pool.connects == 1
            assert pool.stale_retries == 0
            assert len(srv.requests) == 2

    run(main())


def test_idle_connection_past_idle_timeout_is_not_reused(run: Run[None]) -> None:
    async def main() -> None:
        async with ScriptedServer(echo) as srv, UpstreamPool(idle_timeout_s=0.05) as pool:
            await (await pool.request(HOST, srv.port, "POST", "/", b"")).read()
            await asyncio.sleep(0.1)  # the behaviour under test is the passage of time
            await (await pool.request(HOST, srv.port, "POST", "/", b"")).read()
            assert srv.connections == 2
            assert pool.stale_retries == 0

    run(main())


def test_idle_sweep_closes_connections_past_idle_timeout(run: Run[None]) -> None:
    async def main() -> None:
        async with ScriptedServer(echo) as srv, UpstreamPool(idle_timeout_s=0.05) as pool:
            await (await pool.request(HOST, srv.port, "POST", "/", b"")).read()
            assert pool.idle_count(HOST, srv.port) == 1
            await srv.finished[0].wait()  # the sweep closed it without another request
            assert pool.idle_count(HOST, srv.port) == 0
            await until(lambda: pool.open_count == 0, "swept connection is lost")

    run(main())


def test_idle_connections_are_reused_newest_first(run: Run[None]) -> None:
    async def main() -> None:
        both_in = asyncio.Event()

        async def handler(req: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            if req.path == "/pair" and len(srv.requests) == 2:
                both_in.set()
            await both_in.wait()
            writer.write(response(b"%d" % req.conn))  # name the connection that served it
            await writer.drain()

        async with ScriptedServer(handler) as srv, UpstreamPool() as pool:
            first, second = await asyncio.gather(
                pool.request(HOST, srv.port, "POST", "/pair", b""), pool.request(HOST, srv.port, "POST", "/pair", b"")
            )
            await first.read()
            newest = await second.read()  # released last, so on top of the stack
            assert pool.idle_count(HOST, srv.port) == 2
            assert await (await pool.request(HOST, srv.port, "POST", "/next", b"")).read() == newest

    run(main())


def test_max_idle_per_host_caps_the_idle_stack(run: Run[None]) -> None:
    async def main() -> None:
        all_in = asyncio.Event()

        async def handler(req: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            if len(srv.requests) == 3:
                all_in.set()
            await all_in.wait()
            await echo(req, reader, writer)

        async with ScriptedServer(handler) as srv, UpstreamPool(max_idle_per_host=2) as pool:
            resps = await asyncio.gather(*(pool.request(HOST, srv.port, "POST", "/", b"") for _ in range(3)))
            for resp in resps:
                await resp.read()
            assert srv.connections == 3
            assert pool.idle_count(HOST, srv.port) == 2
            await until(lambda: pool.open_count == 2, "the surplus connection is closed")

    run(main())


def test_abort_after_completion_leaves_the_pooled_connection_alone(run: Run[None]) -> None:
    async def main() -> None:
        async with ScriptedServer(echo) as srv, UpstreamPool() as pool:
            resp = await pool.request(HOST, srv.port, "POST", "/", b"")
            await resp.read()
            resp.abort()
            resp.abort()
            await (await pool.request(HOST, srv.port, "POST", "/", b"")).read()
            assert srv.connections == 1

    run(main())


def test_close_closes_idle_connections_and_refuses_new_requests(run: Run[None]) -> None:
    async def main() -> None:
        async with ScriptedServer(echo) as srv:
            pool = UpstreamPool()
            await (await pool.request(HOST, srv.port, "POST", "/", b"")).read()
            await pool.close()
            assert pool.open_count == 0
            await srv.finished[0].wait()
            with pytest.raises(UpstreamConnectError):
                await pool.request(HOST, srv.port, "POST", "/", b"")
            await pool.close()  # idempotent

    run(main())


def test_invalid_limits_are_rejected() -> None:
    with pytest.raises(ValueError, match="idle_timeout_s"):
        UpstreamPool(idle_timeout_s=0)
    with pytest.raises(ValueError, match="max_idle_per_host"):
        UpstreamPool(max_idle_per_host=-1)


def test_bytes_on_an_idle_connection_close_it(run: Run[None]) -> None:
    async def main() -> None:
        was_read = asyncio.Event()

        async def handler(req: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await echo(req, reader, writer)
            if req.conn == 0:
                await was_read.wait()
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")  # answers nothing
                await writer.drain()

        async with ScriptedServer(handler) as srv, UpstreamPool() as pool:
            await (await pool.request(HOST, srv.port, "POST", "/a", b"")).read()
            was_read.set()
            await until(lambda: pool.idle_count(HOST, srv.port) == 0, "the idle connection is dropped")
            assert await (await pool.request(HOST, srv.port, "POST", "/b", b"")).read() == b"/b|"
            assert srv.connections == 2

    run(main())


def test_concurrent_close_calls_both_return(run: Run[None]) -> None:
    async def main() -> None:
        async with ScriptedServer(echo) as srv:
            pool = UpstreamPool()
            await (await pool.request(HOST, srv.port, "POST", "/", b"")).read()
            await asyncio.gather(pool.close(), pool.close())
            assert pool.open_count == 0

    run(main())
