"""Many requests in flight at once across hosts: every response reaches its own caller."""

from __future__ import annotations

import asyncio
import random

from shmdisagg.upstream import UpstreamPool
from tests.unit.upstream._server import Request, ScriptedServer, chunk, chunked_head, response
from tests.unit.upstream.conftest import Run

HOST = "127.0.0.1"


async def echo_slowly(req: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Echo the body, as Content-Length or as chunked pieces, after yielding a random number of times
    so that responses complete out of order."""
    for _ in range(random.randrange(5)):
        await asyncio.sleep(0)
    if req.path == "/stream":
        writer.write(chunked_head(b"text/event-stream"))
        for i in range(0, len(req.body), 7):
            writer.write(chunk(req.body[i : i + 7]))
            await writer.drain()
        writer.write(chunk(b""))
    else:
        writer.write(response(req.body))
    await writer.drain()


def test_200_concurrent_requests_across_two_hosts_are_all_correct(run: Run[None]) -> None:
    async def main() -> None:
        async with ScriptedServer(echo_slowly) as a, ScriptedServer(echo_slowly) as b, UpstreamPool() as pool:
            ports = [a.port, b.port]

            async def one(i: int) -> bytes:
                port = ports[i % 2]
                body = b'{"request": %d, "port": %d}' % (i, port)
                resp = await pool.request(HOST, port, "POST", "/stream" if i % 3 == 0 else "/json", body)
                if i % 3 == 0:
                    return b"".join([c async for c in resp])
                return await resp.read()

            for _ in range(2):  # the second round runs on pooled connections
                results = await asyncio.gather(*(one(i) for i in range(200)))
                for i, got in enumerate(results):
                    assert got == b'{"request": %d, "port": %d}' % (i, ports[i % 2])
            assert a.connections + b.connections == pool.connects
            assert pool.connects <= 400
            assert len(a.requests) == len(b.requests) == 200
            assert pool.idle_count(HOST, a.port) + pool.idle_count(HOST, b.port) == pool.open_count

    run(main())
