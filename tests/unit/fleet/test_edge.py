"""The public port's connection hygiene (`shmdisagg/fleet/edge.py`), over real sockets: uvicorn
with the fleet worker's protocol class on uvloop, in front of an app that reads the whole body
(as every public route does) and answers how much it got. Every test runs twice: with
`POST /v1/completions` served through ASGI, and as a hot route the protocol parses itself
(`fleet/hot.py`, the fleet worker's default). Deadlines are short (0.3 s); nothing waits on a
sleep: a test reads its socket until the server answers or closes, bounded."""

from __future__ import annotations

import asyncio
import contextlib
import resource
import socket
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import orjson
import pytest
import uvicorn
import uvloop

from shmdisagg.fleet.edge import (
    FD_RESERVE,
    FDS_PER_CONNECTION,
    MAX_HEAD_BYTES,
    EdgeLimits,
    edge_protocol,
    fit_connections,
)
from shmdisagg.fleet.hot import HotCycle, HotHandler
from shmdisagg.serving import EmbeddedServer

DEADLINE_S = 0.3
READ_TIMEOUT_S = 10.0  # bounds every read: a server that never answers fails the test here
LIMITS = EdgeLimits(
    client_header_timeout_s=DEADLINE_S,
    client_body_timeout_s=DEADLINE_S,
    max_request_body_bytes=2048,
    worker_connections=64,
)
POST_HEAD = b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"


async def app(scope: dict[str, Any], receive: Callable[[], Any], send: Callable[[Any], Any]) -> None:
    """Reads the whole body, answers `{"received": <bytes>}`; `/early` answers without reading
    it (as a route does that refuses a request on its headers), `/slow` answers 1 s after it
    read it (an executor's generation time)."""
    if scope["type"] != "http":
        return
    if scope["path"] == "/early":
        await send(
            {
                "type": "http.response.start",
                "status": 415,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"2")],
            }
        )
        await send({"type": "http.response.body", "body": b"{}"})
        return
    size, more = 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    if scope["path"] == "/slow":
        await asyncio.sleep(1.0)  # the app's own work, longer than every deadline of the test
    body = orjson.dumps({"received": size})
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def hot_app(cycle: HotCycle) -> None:
    """`app`'s answer for the hot routes, written through the cycle's `Responder` calls."""
    body = orjson.dumps({"received": len(cycle.request_body())})
    await cycle.start(200, [(b"content-type", b"application/json")])
    await cycle.body(body, False)


HOT: HotHandler | None = None  # set per test by `served_as`


@pytest.fixture(params=["asgi", "hot"], autouse=True)
def served_as(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(sys.modules[__name__], "HOT", hot_app if request.param == "hot" else None)
    return str(request.param)


@contextlib.asynccontextmanager
async def serving(
    port: int, limits: EdgeLimits = LIMITS, keep_alive_s: float = 5.0, hot: HotHandler | None = None
) -> AsyncIterator[EmbeddedServer]:
    """uvicorn on 127.0.0.1:`port` configured as a fleet worker configures it (fleet/worker.py)."""
    config = uvicorn.Config(
        app,
        loop="none",
        http=edge_protocol(limits, hot or HOT),
        lifespan="off",
        access_log=False,
        log_level="warning",
        timeout_keep_alive=keep_alive_s,
        timeout_graceful_shutdown=1,
    )  # type: ignore[arg-type]  # a float works
    server = EmbeddedServer(config)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    try:
        async with asyncio.timeout(READ_TIMEOUT_S):
            while not server.started:
                await asyncio.sleep(0.01)  # polls the start (no event to wait on)
        yield server
    finally:
        server.should_exit = True
        await task
        sock.close()


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return uvloop.run(coro)


async def until_eof(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes the connection."""
    async with asyncio.timeout(READ_TIMEOUT_S):
        return await reader.read(-1)


async def one_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One Content-Length response from `reader`: status, headers (lower-case names), body."""
    async with asyncio.timeout(READ_TIMEOUT_S):
        head = await reader.readuntil(b"\r\n\r\n")
        status, headers = parse_head(head)
        return status, headers, await reader.readexactly(int(headers["content-length"]))


def parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    headers = dict((k.strip().lower(), v.strip()) for k, v in (line.split(":", 1) for line in lines[1:] if line))
    return int(lines[0].split(" ")[1]), headers


def parse(raw: bytes) -> tuple[int, dict[str, str], Any]:
    """A whole response read until EOF: status, headers, JSON body."""
    head, _, body = raw.partition(b"\r\n\r\n")
    status, headers = parse_head(head + b"\r\n\r\n")
    assert len(body) == int(headers["content-length"]), raw
    return status, headers, orjson.loads(body)


def assert_error(raw: bytes, status: int, kind: str) -> dict[str, Any]:
    """`raw` is one `status` response in TensorRT-LLM's ErrorResponse shape, then the close."""
    code, headers, body = parse(raw)
    assert code == status, raw
    assert headers["connection"] == "close" and headers["content-type"] == "application/json"
    assert set(body) == {"object", "message", "type", "param", "code"}, body
    assert body["object"] == "error" and body["type"] == kind and body["code"] == status and body["param"] is None
    return body


async def trickle(writer: asyncio.StreamWriter, data: bytes, every_s: float = 0.05) -> None:
    """Send `data` a byte at a time (a slow client), until the server closes."""
    with contextlib.suppress(ConnectionError):
        for i in range(len(data)):
            writer.write(data[i : i + 1])
            await writer.drain()
            await asyncio.sleep(every_s)  # the client's pace, not a synchronisation


def answer_to(port: int, data: bytes) -> bytes:
    """Everything a server on `port` sends back to `data`, sent in one write, until it closes."""

    async def main() -> bytes:
        async with serving(port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(data)
            raw = await until_eof(reader)
            writer.close()
            return raw

    return run(main())


def request(body: bytes = b"{}") -> bytes:
    return POST_HEAD + b"content-length: %d\r\n\r\n%s" % (len(body), body)


def test_a_trickled_head_gets_408_and_the_connection_closes(port: int) -> None:
    async def main() -> tuple[bytes, float]:
        async with serving(port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            start = asyncio.get_running_loop().time()
            sender = asyncio.ensure_future(trickle(writer, request()))  # ~8 s at this pace
            raw = await until_eof(reader)
            sender.cancel()
            writer.close()
            return raw, asyncio.get_running_loop().time() - start

    raw, took = run(main())
    body = assert_error(raw, 408, "RequestTimeoutError")
    assert "head" in body["message"]
    assert took >= DEADLINE_S * 0.9  # not before the deadline


def test_the_head_deadline_restarts_with_each_request_of_a_keep_alive_connection(port: int) -> None:
    """Requests on a connection older than the head deadline are served (pipelined ones too),
    then a trickled one gets the 408: the deadline counts from each request's first byte."""

    async def main() -> tuple[int, bytes]:
        async with serving(port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request(b"a") + request(b"bb") + request(b"ccc"))  # pipelined: one write, three requests
            assert [(await one_response(reader))[::2] for _ in range(3)] == [
                (200, b'{"received":%d}' % n) for n in (1, 2, 3)
            ]
            # the connection now outlives one head deadline, idle (keep-alive is 5 s): poll that
            # it stays open by reading with a timeout longer than the deadline
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(DEADLINE_S * 2):
                    assert await reader.read(1) == b"", "the server sent something unasked"
            writer.write(request(b'{"n": 2}'))
            status = (await one_response(reader))[0]
            sender = asyncio.ensure_future(trickle(writer, request()))
            raw = await until_eof(reader)
            sender.cancel()
            writer.close()
            return status, raw

    status, raw = run(main())
    assert status == 200
    assert_error(raw, 408, "RequestTimeoutError")


def test_idle_connections_are_closed_without_an_answer(port: int) -> None:
    """A connection that never sends a byte is closed at the head deadline; a keep-alive one
    idle for `server_keep_alive_timeout` (this protocol's own timer) then, not before."""

    async def main() -> tuple[bytes, int, bytes, float]:
        async with serving(port, keep_alive_s=2 * DEADLINE_S):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            silent = await until_eof(reader)
            writer.close()
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request())
            status = (await one_response(reader))[0]
            idle_since = asyncio.get_running_loop().time()
            after = await until_eof(reader)
            writer.close()
            return silent, status, after, asyncio.get_running_loop().time() - idle_since

    silent, status, after, idle = run(main())
    assert silent == b""
    assert status == 200 and after == b""
    assert idle >= 2 * DEADLINE_S * 0.9


def test_a_trickled_body_gets_408_and_the_connection_closes(port: int) -> None:
    """The body deadline covers the whole body: one that takes longer than the head deadline
    but arrives within the body's is served, one that drips on gets the 408. Neither deadline
    limits the app: an answer that takes longer than both is served."""

    async def main() -> tuple[tuple[int, bytes], tuple[int, bytes], bytes]:
        async with serving(port, EdgeLimits(DEADLINE_S, 3 * DEADLINE_S, 2048, 64)):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(POST_HEAD + b"content-length: 8\r\n\r\n")
            await trickle(writer, b"x" * 8)  # 0.4 s
            served = (await one_response(reader))[::2]
            writer.close()
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", port
            )  # the head deadline passes while the app works
            writer.write(request(b"slow").replace(b"/v1/completions", b"/slow"))  # 1 s of work
            slow = (await one_response(reader))[::2]
            writer.close()
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(POST_HEAD + b"content-length: 1000\r\n\r\n")
            sender = asyncio.ensure_future(trickle(writer, b"x" * 1000))  # 50 s at this pace
            raw = await until_eof(reader)
            sender.cancel()
            writer.close()
            return served, slow, raw

    served, slow, raw = run(main())
    assert served == (200, b'{"received":8}')
    assert slow == (200, b'{"received":4}')
    body = assert_error(raw, 408, "RequestTimeoutError")
    assert "body" in body["message"]


def test_the_rest_of_a_body_answered_early_is_dropped_under_the_body_deadline(port: int) -> None:
    """A request answered before its body was read (a route that refuses it on its headers):
    the rest of the body is dropped as it comes and the connection serves the next request; if
    the rest never comes, the connection is closed at the body deadline, without a second answer."""

    async def main() -> tuple[bytes, tuple[int, bytes], bytes]:
        async with serving(port):
            early = (
                b"POST /early HTTP/1.1\r\nhost: t\r\ncontent-type: text/plain\r\ncontent-length: 1000\r\n\r\n"
                + b"x" * 10
            )
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(early)
            async with asyncio.timeout(READ_TIMEOUT_S):
                first = await reader.readuntil(b"{}")
            writer.write(b"x" * 990 + request(b"next"))  # the rest of the body, then a request
            reused = (await one_response(reader))[::2]
            writer.close()
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(early)  # and the rest never comes
            abandoned = await until_eof(reader)
            writer.close()
            return first, reused, abandoned

    first, reused, abandoned = run(main())
    assert first.startswith(b"HTTP/1.1 415 ") and first.endswith(b"\r\n\r\n{}"), first
    assert reused == (200, b'{"received":4}')
    assert abandoned.startswith(b"HTTP/1.1 415 ") and abandoned.endswith(b"\r\n\r\n{}"), (
        abandoned
    )  # one answer, then the close


@pytest.mark.parametrize("expect", [False, True], ids=["plain", "expect-100-continue"])
def test_a_declared_length_over_the_limit_gets_413_before_the_body(port: int, expect: bool) -> None:
    async def main() -> bytes:
        async with serving(port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request(b"x" * 2048))  # at the limit: served, on the same connection as what follows
            assert (await one_response(reader))[::2] == (200, b'{"received":2048}')
            writer.write(
                POST_HEAD + b"content-length: 2049\r\n" + (b"expect: 100-continue\r\n" if expect else b"") + b"\r\n"
            )  # no body
            raw = await until_eof(reader)
            writer.close()
            return raw

    raw = run(main())
    assert not raw.startswith(b"HTTP/1.1 100"), raw  # no invitation to send the body first
    body = assert_error(raw, 413, "RequestEntityTooLarge")
    assert body["message"] == "request body is larger than 2048 bytes"


def test_a_chunked_body_gets_413_as_soon_as_it_passes_the_limit(port: int) -> None:
    async def main() -> bytes:
        async with serving(port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                POST_HEAD
                + b"transfer-encoding: chunked\r\n\r\n"
                + (b"3e8\r\n" + b"x" * 1000 + b"\r\n") * 2
                + b"0\r\n\r\n"
            )
            assert (await one_response(reader))[::2] == (200, b'{"received":2000}')  # within the limit: served
            writer.write(POST_HEAD + b"transfer-encoding: chunked\r\n\r\n")
            for _ in range(3):  # 3000 bytes, no terminating chunk: the 413 must not wait for it
                writer.write(b"3e8\r\n" + b"x" * 1000 + b"\r\n")
            raw = await until_eof(reader)
            writer.close()
            return raw

    assert_error(run(main()), 413, "RequestEntityTooLarge")


def test_the_connection_cap_answers_503_keeps_the_others_and_frees_a_place(port: int) -> None:
    async def main() -> tuple[bytes, list[int], int]:
        async with serving(port, EdgeLimits(5.0, 5.0, 2048, worker_connections=3)):
            conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
            for reader, writer in conns:  # each one accepted and served
                writer.write(request())
                assert (await one_response(reader))[0] == 200
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request())
            refused = await until_eof(reader)
            writer.close()
            again = []
            for reader, writer in conns:  # the earlier ones are still served
                writer.write(request())
                again.append((await one_response(reader))[0])
            conns[0][1].close()
            await conns[0][1].wait_closed()
            # once the server has seen that close, a new connection is served: poll for it
            while True:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(request())
                status, _, _ = await one_response(reader)
                writer.close()
                if status == 200:
                    break
                assert status == 503
            for _, w in conns[1:]:
                w.close()
            return refused, again, status

    refused, again, status = run(main())
    body = assert_error(refused, 503, "ServiceUnavailableError")
    assert "connections" in body["message"]
    assert parse(refused)[1]["retry-after"] == "1"
    assert again == [200, 200, 200]
    assert status == 200


def client_hello() -> bytes:
    """The first bytes an https:// client sends: Python's own TLS ClientHello, taken from memory."""
    tls = ssl.create_default_context().wrap_bio(ssl.MemoryBIO(), out := ssl.MemoryBIO(), server_hostname="t")
    with contextlib.suppress(ssl.SSLWantReadError):  # it waits for the server's answer
        tls.do_handshake()
    return out.read()


@pytest.mark.parametrize(
    "garbage, reason",
    [
        (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\xaa" * 64, "TLS is not served"),  # https:// to this port
        (client_hello(), "use http://, not https://"),
        (b"\x16\x04\x01hello\r\n\r\n", "Invalid method"),  # the same first byte, not a TLS record
        (b"hello there\r\n\r\n", "Invalid method"),
        (b"GET / HTTP/1.1\r\nbad header name: x\r\n\r\n", "header"),
        (b"GET / HTTP/1.1\r\nhost: x\x01\r\n\r\n", "header value"),
        (POST_HEAD + b"transfer-encoding: chunked\r\n\r\nzz\r\n", "chunk size"),
        (POST_HEAD + b"content-length: 1\r\ncontent-length: 2\r\n\r\n", "Content-Length"),
        (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", "HTTP/2"),
    ],
    ids=[
        "tls",
        "tls-ssl-module",
        "not-tls",
        "garbage",
        "header-name",
        "header-value",
        "chunk-size",
        "two-lengths",
        "http2-preface",
    ],
)
def test_what_the_parser_refuses_gets_400_in_the_openai_shape(port: int, garbage: bytes, reason: str) -> None:
    body = assert_error(answer_to(port, garbage), 400, "BadRequestError")
    assert reason.lower() in body["message"].lower(), body
    assert len(body["message"]) < 200


def test_an_upgrade_is_refused_with_a_body_and_ignored_without(port: int) -> None:
    """httptools stops at the head of an upgrade request: one with a body gets a 400 (its body
    would never be read); a bodiless one (curl --http2 on http:// asks for h2c) is answered as
    HTTP/1.1."""

    async def main() -> tuple[tuple[int, bytes], bytes]:
        async with serving(port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                b"GET / HTTP/1.1\r\nhost: t\r\nconnection: Upgrade, HTTP2-Settings\r\nupgrade: "
                b"h2c\r\nhttp2-settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n\r\n"
            )
            served = (await one_response(reader))[::2]
            writer.write(POST_HEAD + b"connection: upgrade\r\nupgrade: foo\r\ncontent-length: 2\r\n\r\n{}")
            raw = await until_eof(reader)
            writer.close()
            return served, raw

    served, raw = run(main())
    assert served == (200, b'{"received":0}')
    body = assert_error(raw, 400, "BadRequestError")
    assert "upgrade" in body["message"]


def test_a_head_over_the_size_limit_gets_431(port: int) -> None:
    async def main() -> bytes:
        async with serving(port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(POST_HEAD)
            with contextlib.suppress(ConnectionError):
                for _ in range(MAX_HEAD_BYTES // 4096 + 70):  # header lines, in many reads, never the blank line
                    writer.write(b"x-filler: " + b"a" * 4084 + b"\r\n")
                    await writer.drain()
            raw = await until_eof(reader)
            writer.close()
            return raw

    body = assert_error(run(main()), 431, "BadRequestError")
    assert "head" in body["message"]


@pytest.mark.parametrize(
    "head",
    [
        b"GET /" + b"a" * (MAX_HEAD_BYTES + 10) + b" HTTP/1.1\r\nhost: t\r\n\r\n",
        POST_HEAD
        + b"".join(b"x-filler-%d: %s\r\n" % (i, b"a" * 1000) for i in range(70))
        + b"content-length: 2\r\n\r\n{}",
    ],
    ids=["target", "headers"],
)
def test_a_head_over_the_size_limit_in_one_write_gets_431(port: int, head: bytes) -> None:
    """The limit counts the head as parsed, so a head that arrives in one read is held to it
    too (a count of the reads after the first let ~140-200 KB through)."""

    body = assert_error(answer_to(port, head), 431, "BadRequestError")
    assert body["message"] == f"the request head is larger than {MAX_HEAD_BYTES} bytes"


def test_a_head_just_under_the_size_limit_is_served(port: int) -> None:
    async def main() -> tuple[int, bytes]:
        async with serving(port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                POST_HEAD
                + b"".join(b"x-filler-%02d: %s\r\n" % (i, b"a" * 1000) for i in range(60))
                + b"content-length: 2\r\n\r\n{}"
            )
            got = (await one_response(reader))[::2]
            writer.close()
            return got

    assert run(main()) == (200, b'{"received":2}')


@pytest.mark.parametrize(
    "refused, status",
    [
        (b"hello there\r\n\r\n", 400),
        (b"GET /" + b"a" * (MAX_HEAD_BYTES + 10) + b" HTTP/1.1\r\nhost: t\r\n\r\n", 431),
        (request(b"x" * 4000), 413),
        (POST_HEAD + b"transfer-encoding: chunked\r\n\r\n" + (b"3e8\r\n" + b"x" * 1000 + b"\r\n") * 3, 413),
    ],
    ids=["garbage", "head-too-large", "declared-too-large", "chunked-too-large"],
)
@pytest.mark.parametrize("before", [1, 2], ids=["one-before", "two-before"])
def test_requests_pipelined_before_refused_bytes_are_answered_first(
    port: int, refused: bytes, status: int, before: int
) -> None:
    """Valid requests sent in the same write as bytes that are refused get their answers, in
    order, then the refusal, then the close (nothing the client sent whole is lost)."""

    async def main() -> tuple[list[tuple[int, bytes]], bytes]:
        async with serving(port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"".join(request(b'{"n":%d}' % i) for i in range(before)) + refused)
            served = [(await one_response(reader))[::2] for _ in range(before)]
            raw = await until_eof(reader)
            writer.close()
            return served, raw

    served, raw = run(main())
    assert served == [(200, b'{"received":%d}' % len(b'{"n":%d}' % i)) for i in range(before)]
    assert_error(raw, status, "RequestEntityTooLarge" if status == 413 else "BadRequestError")


def test_a_request_answered_slowly_is_answered_before_the_refusal_of_the_next(port: int) -> None:
    """Bytes refused while a response is being worked on (`/slow`) do not cancel it: its answer,
    then the refusal."""

    async def main() -> tuple[tuple[int, bytes], bytes]:
        async with serving(port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(POST_HEAD.replace(b"/v1/completions", b"/slow") + b"content-length: 2\r\n\r\n{}")
            await writer.drain()
            writer.write(b"hello there\r\n\r\n")
            served = (await one_response(reader))[::2]
            raw = await until_eof(reader)
            writer.close()
            return served, raw

    served, raw = run(main())
    assert served == (200, b'{"received":2}')
    assert_error(raw, 400, "BadRequestError")


@pytest.mark.parametrize(
    "head, reason",
    [
        (b"CONNECT example.com:443 HTTP/1.1\r\nhost: example.com:443\r\n\r\n", "CONNECT is not served on this port"),
        (b"GET http://[::1 HTTP/1.1\r\nhost: t\r\n\r\n", "the request target is not a valid URL"),
    ],
    ids=["connect", "bad-target"],
)
def test_a_request_target_that_is_not_a_url_gets_400_with_the_reason(port: int, head: bytes, reason: str) -> None:
    body = assert_error(answer_to(port, head), 400, "BadRequestError")
    assert reason in body["message"], body
    assert b"example.com" not in orjson.dumps(body)  # the input is not echoed


def test_connections_fit_under_the_descriptor_limit() -> None:
    assert fit_connections(4096, 1 << 20) == 4096
    assert fit_connections(4096, 4096) == (4096 - FD_RESERVE) // FDS_PER_CONNECTION
    assert fit_connections(4096, 100) == 1


def test_a_worker_raises_its_descriptor_limit_and_clamps_the_cap_once(tmp_path: Any) -> None:
    """With a soft limit of 256 and a hard one of 2048, a worker starts with 2048 descriptors and
    at most (2048 - 256) / 2 connections, and says so."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"the hard RLIMIT_NOFILE here is {hard}")
    script = (
        "import logging, resource\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, 2048))\n"
        "logging.basicConfig(level=logging.INFO, format='%(levelname)s %(message)s')\n"
        "from shmdisagg.config import DisaggConfig\n"
        "from shmdisagg.fleet.edge import EdgeLimits\n"
        "c = DisaggConfig.model_validate({'context_servers': {'urls': ['127.0.0.1:1']}, 'generation_servers': "
        "{'urls': ['127.0.0.1:2']}})\n"
        "print('cap', EdgeLimits.for_worker(c).worker_connections, 'soft', "
        "resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["cap", str((2048 - FD_RESERVE) // FDS_PER_CONNECTION), "soft", "2048"], out
    log = out.stderr.splitlines()
    assert any("RLIMIT_NOFILE: soft limit 2048 (was 256), hard limit 2048" in line for line in log), log
    clamps = [line for line in log if line.startswith("WARNING") and "worker_connections 4096" in line]
    assert len(clamps) == 1, log
