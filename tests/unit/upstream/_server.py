"""A scripted HTTP/1.1 server for the upstream tests: each test supplies the handler that writes
raw response bytes, so framing, timing and misbehaviour are under the test's control."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field


@dataclass
class Request:
    """One request as the server read it. `conn` numbers connections from 0 in accept order;
    `seq` numbers requests on that connection from 0."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    conn: int
    seq: int


# Returns False to close the connection after the handler (no more requests read on it).
Handler = Callable[[Request, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[bool | None]]


def response(body: bytes, *, status: str = "200 OK", headers: bytes = b"") -> bytes:
    """A whole Content-Length response."""
    return b"HTTP/1.1 %s\r\ncontent-length: %d\r\n%s\r\n%s" % (status.encode(), len(body), headers, body)


def chunked_head(content_type: bytes = b"application/octet-stream") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ntransfer-encoding: chunked\r\n\r\n" % content_type


def chunk(data: bytes) -> bytes:
    """One chunk of a chunked body; chunk(b"") is the terminator."""
    return b"%x\r\n%s\r\n" % (len(data), data)


async def echo(req: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answer with the path and body, so every response names its request."""
    writer.write(response(req.path.encode() + b"|" + req.body, headers=b"content-type: application/json\r\n"))
    await writer.drain()


async def wait_for_eof(reader: asyncio.StreamReader) -> None:
    """Block until the client closes the connection (or resets it)."""
    with contextlib.suppress(ConnectionError):
        while await reader.read(65536):
            pass


async def _read_request(reader: asyncio.StreamReader, conn: int, seq: int) -> Request | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return Request(method, path, headers, body, conn, seq)


@dataclass
class ScriptedServer:
    """Serves `handler` on 127.0.0.1, port chosen by the OS. Use as `async with`.

    connections: connections accepted so far.
    requests: every request read, in order.
    finished: per connection, set once the server is done with it (client left, or handler closed it).
    """

    handler: Handler
    port: int = 0
    connections: int = 0
    requests: list[Request] = field(default_factory=list)
    finished: list[asyncio.Event] = field(default_factory=list)
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def __aenter__(self) -> ScriptedServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        conn = self.connections
        self.connections += 1
        done = asyncio.Event()
        self.finished.append(done)
        try:
            seq = 0
            while True:
                req = await _read_request(reader, conn, seq)
                if req is None:
                    break
                self.requests.append(req)
                if await self.handler(req, reader, writer) is False:
                    break
                seq += 1
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            pass  # cancelled by __aexit__; end normally (3.11's stream callback chokes on a cancelled task)
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, asyncio.CancelledError):
                await writer.wait_closed()
            done.set()
            self._tasks.discard(task)


async def until(condition: Callable[[], bool], what: str) -> None:
    """Yield to the loop until `condition()` holds: for state that settles within a few loop
    iterations after an event the test already awaited (e.g. the client's connection_lost
    callback after the server saw the socket close). Fails after 5 s."""
    try:
        async with asyncio.timeout(5):
            while not condition():
                await asyncio.sleep(0.001)
    except TimeoutError:
        raise AssertionError(f"never became true: {what}") from None
