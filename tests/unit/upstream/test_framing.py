"""Response framing and request encoding: Content-Length, chunked, read-until-close, SSE, HEAD, 1xx."""

from __future__ import annotations

import asyncio
import os

from shmdisagg.upstream import UpstreamPool
from tests.unit.upstream._server import Request, ScriptedServer, chunk, chunked_head, echo, response
from tests.unit.upstream.conftest import Run

HOST = "127.0.0.1"


def test_content_length_body_is_read_whole(run: Run[None]) -> None:
    async def main() -> None:
        async with ScriptedServer(echo) as srv, UpstreamPool() as pool:
            resp = await pool.request(HOST, srv.port, "POST", "/v1/completions", b'{"a":1}')
            assert resp.status == 200
            assert resp.header(b"content-type") == b"application/json"
            assert resp.header(b"x-missing") is None
            assert not resp.is_event_stream
            assert await resp.read() == b'/v1/completions|{"a":1}'
            assert await resp.read() == b""  # consumed

    run(main())


def test_request_head_carries_host_content_length_and_caller_headers(run: Run[None]) -> None:
    async def main() -> None:
        async with ScriptedServer(echo) as srv, UpstreamPool() as pool:
            resp = await pool.request(
                HOST,
                srv.port,
                "POST",
                "/p",
                b"hello",
                headers=[(b"content-type", b"application/json"), (b"x-id", b"7")],
            )
            await resp.read()
            resp = await pool.request(HOST, srv.port, "GET", "/health")
            await resp.read()
        post, get = srv.requests
        assert (post.method, post.path, post.body) == ("POST", "/p", b"hello")
        assert post.headers == {
            "host": f"{HOST}:{srv.port}",
            "content-length": "5",
            "content-type": "application/json",
            "x-id": "7",
        }
        assert (get.method, get.path) == ("GET", "/health")
        assert get.headers == {"host": f"{HOST}:{srv.port}"}  # no Content-Length on a bodyless GET

    run(main())


def test_empty_post_body_is_sent_with_content_length_zero(run: Run[None]) -> None:
    async def main() -> None:
        async with ScriptedServer(echo) as srv, UpstreamPool() as pool:
            assert await (await pool.request(HOST, srv.port, "POST", "/p")).read() == b"/p|"
        assert srv.requests[0].headers["content-length"] == "0"

    run(main())


def test_a_body_given_as_pieces_is_sent_as_their_concatenation(run: Run[None]) -> None:
    # A leg whose prompt stays a view of the client's body (splice.dumps): the pieces go out
    # with one vectored write, larger than a socket buffer here, so uvloop finishes it later.
    big = os.urandom(3 << 20)
    pieces: list[bytes | memoryview] = [b'{"prompt":', memoryview(big)[7:-9], b"}"]
    sent = b"".join(pieces)

    async def main() -> None:
        async with ScriptedServer(echo) as srv, UpstreamPool() as pool:
            for _ in range(2):  # the second on the same connection: the framing ended where it should
                resp = await pool.request(HOST, srv.port, "POST", "/v1/completions", pieces, headers=[(b"x-id", b"7")])
                assert await resp.read() == b"/v1/completions|" + sent
        assert [r.body for r in srv.requests] == [sent, sent]
        assert srv.requests[0].headers["content-length"] == str(len(sent))
        assert srv.requests[0].headers["x-id"] == "7"
        assert [r.conn for r in srv.requests] == [0, 0]

    run(main())


def test_chunked_body_is_dechunked(run: Run[None]) -> None:
    async def handler(req: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(chunked_head() + chunk(b"hello, ") + chunk(b"chunked ") + chunk(b"world") + chunk(b""))
        await writer.drain()

    async def main() -> None:
        async with ScriptedServer(handler) as srv, UpstreamPool() as pool:
            assert await (await pool.request(HOST, srv.port, "POST", "/")).read() == b"hello, chunked world"
            assert pool.idle_count(HOST, srv.port) == 1

    run(main())


def test_http10_body_read_until_close_is_complete_and_not_pooled(run: Run[None]) -> None:
    async def handler(req: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.0 200 OK\r\ncontent-type: text/plain\r\n\r\nuntil the end")
        await writer.drain()
        return False

    async def main() -> None:
        async with ScriptedServer(handler) as srv, UpstreamPool() as pool:
            resp = await pool.request(HOST, srv.port, "GET", "/")
            assert await resp.read() == b"until the end"
            assert pool.idle_count(HOST, srv.port) == 0

    run(main())


def test_http11_body_without_length_is_read_until_close(run: Run[None]) -> None:
    async def handler(req: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\npart one, ")
        await writer.drain()
        writer.write(b"part two")
        return False

    async def main() -> None:
        async with ScriptedServer(handler) as srv, UpstreamPool() as pool:
            resp = await pool.request(HOST, srv.port, "GET", "/")
            assert b"".join([c async for c in resp]) == b"part one, part two"
            assert pool.idle_count(HOST, srv.port) == 0

    run(main())


def test_sse_chunks_arrive_one_by_one_without_buffering(run: Run[None]) -> None:
    # The server sends event i only after the client received event i-1: a client that waited
    # for more bytes before yielding would deadlock (and fail on the test deadline).
    events = [b'data: {"i": %d}\n\n' % i for i in range(16)]

    async def main() -> None:
        gates = [asyncio.Event() for _ in events]

        async def handler(req: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(chunked_head(b"text/event-stream"))
            for event, gate in zip(events, gates, strict=True):
                writer.write(chunk(event))
                await writer.drain()
                await gate.wait()
            writer.write(chunk(b""))
            await writer.drain()

        async with ScriptedServer(handler) as srv, UpstreamPool() as pool:
            resp = await pool.request(HOST, srv.port, "POST", "/v1/chat/completions", b"{}")
            assert resp.is_event_stream
            got = []
            async with asyncio.timeout(10):
                async for data in resp:
                    got.append(data)
                    gates[len(got) - 1].set()
            assert got == events
            assert pool.idle_count(HOST, srv.port) == 1

    run(main())


def test_ten_megabyte_bodies_round_trip_intact(run: Run[None]) -> None:
    payload = os.urandom(10 << 20)

    async def main() -> None:
        async def handler(req: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            if req.path == "/echo":
                writer.write(response(req.body))
            else:  # the same bytes back, chunked in uneven pieces
                writer.write(chunked_head())
                for start in range(0, len(payload), 777_777):
                    writer.write(chunk(payload[start : start + 777_777]))
                    await writer.drain()
                writer.write(chunk(b""))
            await writer.drain()

        async with ScriptedServer(handler) as srv, UpstreamPool() as pool:
            assert await (await pool.request(HOST, srv.port, "POST", "/echo", payload)).read() == payload
            resp = await pool.request(HOST, srv.port, "GET", "/chunked")
            assert b"".join([c async for c in resp]) == payload
            assert srv.connections == 1

    run(main())


def test_head_request_ends_at_the_head_and_is_not_pooled(run: Run[None]) -> None:
    async def handler(req: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n")
        await writer.drain()

    async def main() -> None:
        async with ScriptedServer(handler) as srv, UpstreamPool() as pool:
            resp = await pool.request(HOST, srv.port, "HEAD", "/")
            assert resp.header(b"content-length") == b"100"
            assert await resp.read() == b""
            assert pool.idle_count(HOST, srv.port) == 0

    run(main())


def test_interim_100_response_is_skipped(run: Run[None]) -> None:
    async def handler(req: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 100 Continue\r\nx-interim: 1\r\n\r\n" + response(b"ok"))
        await writer.drain()

    async def main() -> None:
        async with ScriptedServer(handler) as srv, UpstreamPool() as pool:
            resp = await pool.request(HOST, srv.port, "POST", "/", b"x")
            assert resp.status == 200
            assert resp.header(b"x-interim") is None
            assert await resp.read() == b"ok"
            assert pool.idle_count(HOST, srv.port) == 1

    run(main())


def test_error_status_is_returned_not_raised(run: Run[None]) -> None:
    async def handler(req: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(response(b'{"error":"bad"}', status="400 Bad Request"))
        await writer.drain()

    async def main() -> None:
        async with ScriptedServer(handler) as srv, UpstreamPool() as pool:
            resp = await pool.request(HOST, srv.port, "POST", "/", b"x")
            assert resp.status == 400
            assert await resp.read() == b'{"error":"bad"}'
            assert pool.idle_count(HOST, srv.port) == 1

    run(main())
