"""The hot routes served on the public port's own connection (`shmdisagg/fleet/hot.py`): framing,
keep-alive, pipelining, `Expect: 100-continue`, a failing handler, a client that leaves, and what
stays on the ASGI path. Over real sockets, through `EdgeProtocol` as a fleet worker runs it
(the connection-hygiene tests of `test_edge.py` run against both paths)."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from shmdisagg.fleet.hot import HotCycle
from tests.unit.fleet.test_edge import POST_HEAD, READ_TIMEOUT_S, one_response, parse_head, request, run, serving


async def answer(cycle: HotCycle) -> None:
    await cycle.start(200, [(b"content-type", b"application/json")])
    await cycle.body(orjson.dumps({"hot": len(cycle.request_body()), "chat": cycle.chat}), False)


async def read_chunks(reader: asyncio.StreamReader) -> list[bytes]:
    """The chunks of a chunked body whose head was read, up to the last chunk."""
    chunks = []
    async with asyncio.timeout(READ_TIMEOUT_S):
        while True:
            size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
            data = await reader.readexactly(size + 2)
            if not size:
                return chunks
            chunks.append(data[:-2])


def test_a_complete_answer_has_its_length_and_keeps_the_connection(port: int) -> None:
    async def main() -> list[tuple[int, dict[str, str], bytes]]:
        async with serving(port, hot=answer):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            out = []
            for body in (b"{}", b'{"a": 1}'):
                writer.write(request(body))
                out.append(await one_response(reader))
            chat = POST_HEAD.replace(b"/v1/completions", b"/v1/chat/completions") + b"content-length: 2\r\n\r\n{}"
            writer.write(chat)
            out.append(await one_response(reader))
            writer.close()
            return out

    (s1, h1, b1), (s2, _, b2), (s3, _, b3) = run(main())
    assert (s1, s2, s3) == (200, 200, 200)
    assert "transfer-encoding" not in h1 and h1["content-type"] == "application/json"
    assert h1["server"] == "uvicorn" and "date" in h1  # uvicorn's default headers, as on every route
    assert orjson.loads(b1) == {"hot": 2, "chat": False} and orjson.loads(b2) == {"hot": 8, "chat": False}
    assert orjson.loads(b3) == {"hot": 2, "chat": True}


def test_a_stream_is_chunked_and_its_head_can_go_first(port: int) -> None:
    sent_head = asyncio.Event()
    go_on = asyncio.Event()

    async def stream(cycle: HotCycle) -> None:
        await cycle.start(200, [(b"content-type", b"text/event-stream")])
        cycle.flush_head()
        sent_head.set()
        await go_on.wait()
        cycle.write_chunk(b"data: 1\n\n")
        await cycle.body(b"data: 2\n\n", True)
        await cycle.body(b"data: [DONE]\n\n", False)

    async def main() -> tuple[bytes, list[bytes]]:
        async with serving(port, hot=stream):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request())
            async with asyncio.timeout(READ_TIMEOUT_S):
                await sent_head.wait()
                head = await reader.readuntil(b"\r\n\r\n")  # before any chunk was written
            go_on.set()
            chunks = await read_chunks(reader)
            writer.close()
            return head, chunks

    head, chunks = run(main())
    status, headers = parse_head(head)
    assert status == 200 and headers["content-type"] == "text/event-stream"
    assert headers["transfer-encoding"] == "chunked" and "content-length" not in headers
    assert chunks == [b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"]


def test_pipelined_requests_are_answered_in_order(port: int) -> None:
    async def slow_first(cycle: HotCycle) -> None:
        body = cycle.request_body()
        if body == b'{"n":0}':
            await asyncio.sleep(0.05)  # the first answer takes longer: the second must wait for it
        await cycle.start(200, [(b"content-type", b"application/json")])
        await cycle.body(body, False)

    async def main() -> list[bytes]:
        async with serving(port, hot=slow_first):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"".join(request(b'{"n":%d}' % i) for i in range(3)))
            bodies = [(await one_response(reader))[2] for _ in range(3)]
            writer.close()
            return bodies

    assert run(main()) == [b'{"n":0}', b'{"n":1}', b'{"n":2}']


def test_expect_100_continue_is_answered_before_the_body_comes(port: int) -> None:
    async def main() -> tuple[bytes, tuple[int, dict[str, str], bytes]]:
        async with serving(port, hot=answer):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(POST_HEAD + b"expect: 100-continue\r\ncontent-length: 5\r\n\r\n")
            async with asyncio.timeout(READ_TIMEOUT_S):
                interim = await reader.readuntil(b"\r\n\r\n")
            writer.write(b"hello")
            final = await one_response(reader)
            writer.close()
            return interim, final

    interim, (status, _, body) = run(main())
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
    assert status == 200 and orjson.loads(body)["hot"] == 5


def test_a_failing_handler_gets_500_and_the_connection_serves_on(port: int) -> None:
    async def fails_once(cycle: HotCycle) -> None:
        if cycle.request_body() == b"boom":
            raise RuntimeError("a bug")
        await answer(cycle)

    async def main() -> list[tuple[int, dict[str, str], bytes]]:
        async with serving(port, hot=fails_once):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request(b"boom"))
            first = await one_response(reader)
            writer.write(request(b"{}"))
            second = await one_response(reader)
            writer.close()
            return [first, second]

    (s1, _, b1), (s2, _, _) = run(main())
    assert (s1, b1, s2) == (500, b"Internal Server Error", 200)


def test_a_client_that_leaves_cancels_the_armed_request(port: int) -> None:
    started = asyncio.Event()
    outcome: dict[str, Any] = {}

    async def waits(cycle: HotCycle) -> None:
        with cycle:
            started.set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                outcome["cancelled"] = cycle.disconnected
                raise

    async def main() -> None:
        async with serving(port, hot=waits):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request())
            async with asyncio.timeout(READ_TIMEOUT_S):
                await started.wait()
                writer.close()
                while "cancelled" not in outcome:
                    await asyncio.sleep(0.01)  # polls the handler's own record (no event to wait on)

    run(main())
    assert outcome == {"cancelled": True}


def test_what_the_exact_match_does_not_take_stays_on_asgi(port: int) -> None:
    """A query string, another method, HTTP/1.0: the ASGI app answers the first two; an HTTP/1.0
    request is hot but its answer closes the connection."""

    async def main() -> list[bytes]:
        out = []
        async with serving(port, hot=answer):
            for head in (
                POST_HEAD.replace(b"/v1/completions", b"/v1/completions?x=1"),
                POST_HEAD.replace(b"POST", b"PUT"),
                POST_HEAD.replace(b"HTTP/1.1", b"HTTP/1.0"),
            ):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(head + b"content-length: 2\r\n\r\n{}")
                async with asyncio.timeout(READ_TIMEOUT_S):
                    out.append(await reader.read(-1))
                writer.close()
        return out

    query, put, http10 = run(main())
    assert b'{"received":2}' in query and b'{"received":2}' in put  # test_edge's ASGI app
    assert b'"hot":2' in http10 and b"connection: close" in http10
