"""Failures: refused, timeouts, drops mid-body, cancellation, abandoned responses, limits, bad HTTP."""

from __future__ import annotations

import asyncio
import gc

import pytest

from shmdisagg.upstream import (
    UpstreamConnectError,
    UpstreamDisconnected,
    UpstreamPool,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from tests.conftest import free_port
from tests.loop_timers import armed_timers
from tests.unit.upstream._server import (
    Request,
    ScriptedServer,
    chunk,
    chunked_head,
    echo,
    response,
    until,
    wait_for_eof,
)
from tests.unit.upstream.conftest import Run

HOST = "127.0.0.1"


async def hold_until_client_leaves(req: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    """Never answer; return once the client closes the connection."""
    await wait_for_eof(reader)
    return False


def test_refused_connection_raises_connect_error(run: Run[None]) -> None:
    async def main() -> None:
        async with UpstreamPool() as pool:
            with pytest.raises(UpstreamConnectError, match="failed"):
                await pool.request(HOST, free_port(), "POST", "/", b"x")
            assert pool.open_count == 0

    run(main())


def test_unresolvable_host_raises_connect_error(run: Run[None]) -> None:
    async def main() -> None:
        async with UpstreamPool() as pool:
            with pytest.raises(UpstreamConnectError):
                await pool.request("no-such-host.invalid", 80, "GET", "/")

    run(main())


def test_missing_head_raises_timeout_and_closes_the_connection(run: Run[None]) -> None:
    async def main() -> None:
        async with ScriptedServer(hold_until_client_leaves) as srv, UpstreamPool() as pool:
            with pytest.raises(UpstreamTimeout):
                await pool.request(HOST, srv.port, "POST", "/", b"x", timeout_s=0.1)
            await srv.finished[0].wait()  # the client closed the socket
            assert pool.idle_count(HOST, srv.port) == 0
            await until(lambda: pool.open_count == 0, "timed-out connection is lost")

    run(main())


def test_timeout_does_not_bound_the_body(run: Run[None]) -> None:
    async def main() -> None:
        release = asyncio.Event()

        async def handler(req: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(chunked_head() + chunk(b"early "))
            await writer.drain()
            await release.wait()
            writer.write(chunk(b"late") + chunk(b""))
            await writer.drain()

        async with ScriptedServer(handler) as srv, UpstreamPool() as pool:
            resp = await pool.request(HOST, srv.port, "POST", "/", b"", timeout_s=0.05)
            chunks = [await resp.__anext__()]
            await asyncio.sleep(0.1)  # well past timeout_s, which covered only the head
            release.set()
            chunks += [c async for c in resp]
            assert b"".join(chunks) == b"early late"

    run(main())


async def answer_first_then_hold(req: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    """Answer a connection's first request; never answer its second."""
    if req.seq == 0:
        await echo(req, reader, writer)
        return True
    await wait_for_eof(reader)
    return False


def test_a_reused_connection_times_out_at_its_later_requests_deadline(run: Run[None]) -> None:
    """The first request armed the connection's timer at its own deadline; the second request's is
    later. The timer fires at the first deadline, finds a later one and follows it: the second
    request fails at its own deadline, not the first's."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        async with ScriptedServer(answer_first_then_hold) as srv, UpstreamPool() as pool:
            await (await pool.request(HOST, srv.port, "POST", "/", b"", timeout_s=0.1)).read()
            t0 = loop.time()
            with pytest.raises(UpstreamTimeout):
                await pool.request(HOST, srv.port, "POST", "/", b"", timeout_s=0.5)
            assert loop.time() - t0 >= 0.45
            assert srv.connections == 1

    run(main())


def test_a_reused_connection_times_out_at_an_earlier_deadline_than_its_timers(run: Run[None]) -> None:
    """The first request's deadline is 30 s away; the second request's, 0.1 s: the timer moves
    earlier, so the second request fails after 0.1 s, not 30 s."""

    async def main() -> None:
        async with ScriptedServer(answer_first_then_hold) as srv, UpstreamPool() as pool:
            await (await pool.request(HOST, srv.port, "POST", "/", b"", timeout_s=30)).read()
            async with asyncio.timeout(10):
                with pytest.raises(UpstreamTimeout):
                    await pool.request(HOST, srv.port, "POST", "/", b"", timeout_s=0.1)
            assert srv.connections == 1

    run(main())


def test_an_idle_connection_outlives_its_last_requests_deadline(run: Run[None]) -> None:
    async def main() -> None:
        async with ScriptedServer(echo) as srv, UpstreamPool() as pool:
            await (await pool.request(HOST, srv.port, "POST", "/", b"", timeout_s=0.05)).read()
            await asyncio.sleep(0.15)  # the behaviour under test is the passage of time
            assert await (await pool.request(HOST, srv.port, "POST", "/2", b"x")).read() == b"/2|x"
            assert srv.connections == 1

    run(main())


def test_a_reused_connection_arms_one_timer_for_many_requests(run: Run[None]) -> None:
    """A call_at and its cancel per request cost 0.6 µs or more in uvloop: a connection keeps one timer
    while its requests' deadlines follow each other."""

    async def main() -> None:
        async with ScriptedServer(echo) as srv, UpstreamPool() as pool:
            await (await pool.request(HOST, srv.port, "POST", "/", b"")).read()  # connected, sweeper armed
            with armed_timers(asyncio.get_running_loop()) as armed:
                for i in range(20):
                    resp = await pool.request(HOST, srv.port, "POST", f"/{i}", b"x", timeout_s=30)
                    assert await resp.read() == f"/{i}|x".encode()
            assert srv.connections == 1
            assert len(armed) == 1

    run(main())


def test_server_closing_mid_body_raises_disconnected_without_retry(run: Run[None]) -> None:
    async def handler(req: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n" + b"x" * 100)
        await writer.drain()
        return False

    async def main() -> None:
        async with ScriptedServer(handler) as srv, UpstreamPool() as pool:
            resp = await pool.request(HOST, srv.port, "POST", "/", b"")
            got = b""
            with pytest.raises(UpstreamDisconnected) as info:
                async for data in resp:
                    got += data
            assert got == b"x" * 100  # bytes before the drop are delivered first
            assert info.value.bytes_received > 100
            assert pool.connects == 1
            assert pool.stale_retries == 0
            assert pool.open_count == 0

    run(main())


def test_server_closing_mid_chunked_body_fails_read(run: Run[None]) -> None:
    async def handler(req: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(chunked_head() + chunk(b"partial"))
        await writer.drain()
        return False

    async def main() -> None:
        async with ScriptedServer(handler) as srv, UpstreamPool() as pool:
            resp = await pool.request(HOST, srv.port, "POST", "/", b"")
            with pytest.raises(UpstreamDisconnected):
                await resp.read()
            with pytest.raises(UpstreamDisconnected):
                await resp.read()  # stays failed rather than pretending the body was empty

    run(main())


def test_cancel_while_awaiting_the_head_closes_the_connection(run: Run[None]) -> None:
    async def main() -> None:
        async with ScriptedServer(hold_until_client_leaves) as srv, UpstreamPool() as pool:
            task = asyncio.create_task(pool.request(HOST, srv.port, "POST", "/", b"x"))
            await until(lambda: len(srv.requests) == 1, "server got the request")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await srv.finished[0].wait()
            assert pool.idle_count(HOST, srv.port) == 0
            await until(lambda: pool.open_count == 0, "cancelled connection is lost")

    run(main())


def test_cancel_while_iterating_closes_the_connection(run: Run[None]) -> None:
    async def handler(req: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(chunked_head(b"text/event-stream") + chunk(b"data: 1\n\n"))
        await writer.drain()
        await wait_for_eof(reader)
        return False

    async def main() -> None:
        got_first = asyncio.Event()

        async def relay() -> None:
            resp = await pool.request(HOST, srv.port, "POST", "/", b"")
            async for _ in resp:
                got_first.set()

        async with ScriptedServer(handler) as srv, UpstreamPool() as pool:
            task = asyncio.create_task(relay())
            await got_first.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await srv.finished[0].wait()
            assert pool.idle_count(HOST, srv.port) == 0
            await until(lambda: pool.open_count == 0, "cancelled connection is lost")
            # The pool still works afterwards, on a new connection.
            srv.handler = echo
            assert await (await pool.request(HOST, srv.port, "POST", "/", b"ok")).read() == b"/|ok"
            assert srv.connections == 2

    run(main())


def test_cancel_during_read_closes_the_connection(run: Run[None]) -> None:
    async def handler(req: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc")
        await writer.drain()
        await wait_for_eof(reader)
        return False

    async def main() -> None:
        async with ScriptedServer(handler) as srv, UpstreamPool() as pool:
            resp = await pool.request(HOST, srv.port, "POST", "/", b"")
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.05):
                    await resp.read()
            await srv.finished[0].wait()
            assert pool.idle_count(HOST, srv.port) == 0

    run(main())


def test_abort_from_another_task_fails_the_reader(run: Run[None]) -> None:
    async def handler(req: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(chunked_head() + chunk(b"first"))
        await writer.drain()
        await wait_for_eof(reader)
        return False

    async def main() -> None:
        async with ScriptedServer(handler) as srv, UpstreamPool() as pool:
            resp = await pool.request(HOST, srv.port, "POST", "/", b"")
            assert await resp.__anext__() == b"first"
            conn = resp._conn
            assert conn is not None
            reader = asyncio.create_task(resp.__anext__())
            await until(lambda: conn.waiter is not None, "the reader waits for the next chunk")
            resp.abort()
            with pytest.raises(UpstreamDisconnected):
                await reader
            with pytest.raises(UpstreamDisconnected):
                await resp.read()
            await srv.finished[0].wait()

    run(main())


def test_dropped_unfinished_response_closes_its_connection(run: Run[None]) -> None:
    # The safety net for a caller that neither reads, iterates to the end, nor aborts.
    async def handler(req: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(chunked_head() + chunk(b"never read"))
        await writer.drain()
        await wait_for_eof(reader)
        return False

    async def main() -> None:
        async with ScriptedServer(handler) as srv, UpstreamPool() as pool:
            resp = await pool.request(HOST, srv.port, "POST", "/", b"")
            assert resp.status == 200
            del resp
            gc.collect()
            await srv.finished[0].wait()
            assert pool.idle_count(HOST, srv.port) == 0
            await until(lambda: pool.open_count == 0, "dropped response's connection is lost")

    run(main())


def test_pool_close_fails_responses_in_flight(run: Run[None]) -> None:
    async def handler(req: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(chunked_head() + chunk(b"a"))
        await writer.drain()
        await wait_for_eof(reader)
        return False

    async def main() -> None:
        async with ScriptedServer(handler) as srv:
            pool = UpstreamPool()
            resp = await pool.request(HOST, srv.port, "POST", "/", b"")
            assert await resp.__anext__() == b"a"
            await pool.close()
            assert pool.open_count == 0
            with pytest.raises(UpstreamDisconnected):
                await resp.__anext__()

    run(main())


def test_body_over_max_response_bytes_raises_protocol_error(run: Run[None]) -> None:
    async def handler(req: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(response(b"y" * 2000))
        await writer.drain()

    async def main() -> None:
        async with ScriptedServer(handler) as srv, UpstreamPool(max_response_bytes=1000) as pool:
            resp = await pool.request(HOST, srv.port, "POST", "/", b"")
            with pytest.raises(UpstreamProtocolError, match="over 1000 bytes"):
                await resp.read()
            assert pool.idle_count(HOST, srv.port) == 0

    run(main())


def test_malformed_response_raises_protocol_error(run: Run[None]) -> None:
    async def handler(req: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()
        await wait_for_eof(reader)

    async def main() -> None:
        async with ScriptedServer(handler) as srv, UpstreamPool() as pool:
            with pytest.raises(UpstreamProtocolError, match="malformed"):
                await pool.request(HOST, srv.port, "POST", "/", b"")
            await srv.finished[0].wait()

    run(main())


def test_oversized_response_head_raises_protocol_error(run: Run[None]) -> None:
    async def handler(req: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\n" + b"x-filler: " + b"z" * (80 << 10) + b"\r\n")
        await writer.drain()
        await wait_for_eof(reader)

    async def main() -> None:
        async with ScriptedServer(handler) as srv, UpstreamPool() as pool:
            with pytest.raises(UpstreamProtocolError, match="head"):
                await pool.request(HOST, srv.port, "POST", "/", b"")

    run(main())


def test_second_response_to_one_request_is_not_taken_as_the_next(run: Run[None]) -> None:
    # An executor that answers twice must not have its extra response delivered to the next request.
    async def handler(req: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(response(b"one") + response(b"two"))
        await writer.drain()

    async def main() -> None:
        async with ScriptedServer(handler) as srv, UpstreamPool() as pool:
            assert await (await pool.request(HOST, srv.port, "POST", "/", b"")).read() == b"one"
            assert await (await pool.request(HOST, srv.port, "POST", "/", b"")).read() == b"one"
            assert srv.connections == 2

    run(main())


def test_bad_request_line_is_rejected_before_sending(run: Run[None]) -> None:
    async def main() -> None:
        async with UpstreamPool() as pool:
            with pytest.raises(ValueError, match="bad request line"):
                await pool.request(HOST, 1, "POST", "/a b", b"")

    run(main())
