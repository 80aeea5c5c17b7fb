"""The two hot routes on the public port's own connection, without an ASGI cycle.

`HotCycle` is one `POST /v1/completions` or `/v1/chat/completions` request on an `EdgeProtocol`
connection, from its parsed head to the last byte of its answer. It stands where uvicorn's
`RequestResponseCycle` stands for every other route: the protocol (uvicorn's and `EdgeProtocol`'s
code) reads and sets the same attributes on it (`more_body`, `keep_alive`, `disconnected`,
`response_started`, `response_complete`, `message_event.set()`), so keep-alive, pipelining,
deadlines, refusals and graceful shutdown work as they do for an ASGI request. What it leaves out
is the ASGI layer itself, which the hot routes only paid for (`BENCHMARKS.md`, issue 14):

- the body is collected by the parser callbacks, and the request's one task starts once it is
  complete (no `receive()` round trips, no `asyncio.Event`);
- the answer is written by the `Responder` calls straight to the transport: a complete answer in
  one write with its `content-length` (uvicorn sends the head and a chunked body in two), a stream
  as HTTP chunks, and a relayed stream's chunks from the executor connection's read callback
  (`write_chunk`, used by `flows.relay`), with no task wake-up per chunk;
- a client that disconnects cancels the request's task from `connection_lost` (no side task
  waiting on `receive()`, which `DisconnectWatch` needs under ASGI).

Observed requests (`return_perf_metrics`, perf files, OTLP, request traces) keep the ASGI path,
whose `send` they wrap (`observe.py`); so do hot paths with a query string or an escaped path,
which FastAPI-style routing would match and this exact match does not.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from uvicorn.protocols.http.httptools_impl import STATUS_LINE

if TYPE_CHECKING:
    from shmdisagg.fleet.edge import EdgeProtocol

# The exact request targets served here, and whether each is the chat route.
HOT_TARGETS = {b"/v1/completions": False, b"/v1/chat/completions": True}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_LAST_CHUNK = b"0\r\n\r\n"
_TEXT = b"text/plain; charset=utf-8"

HotHandler = Callable[["HotCycle"], Awaitable[None]]


class HotCycle:
    """One hot-route request and its answer (module docstring).

    As the service sees it: `chat`, `headers` (raw pairs, names lower-cased), `request_body()`; a
    `Responder` (`start`, `body`); a disconnect watch (`with cycle:` arms it, `disconnected`); and
    for a relayed stream `write_chunk` (synchronous, framed as an HTTP chunk), `writable` and
    `on_writable`, the hook the relay uses to pause the executor's connection while the client's
    socket is full.
    """

    __slots__ = (
        "proto", "transport", "flow", "scope", "chat", "headers", "chunks", "more_body", "keep_alive",
        "disconnected", "response_started", "response_complete", "expect_100", "queued", "task", "armed",
        "on_response", "on_writable", "_status", "_headers",
    )  # fmt: skip
    direct = True  # a Responder that writes from callbacks too (`write_chunk`)

    def __init__(self, proto: EdgeProtocol, chat: bool, keep_alive: bool, expect_100: bool) -> None:
        self.proto = proto
        self.transport = proto.transport
        self.flow = proto.flow
        self.scope = proto.scope  # EdgeProtocol tells a cycle from a WebSocket upgrade by it
        self.chat = chat
        self.headers: list[tuple[bytes, bytes]] = proto.headers
        self.chunks: list[bytes] = []
        self.more_body = True
        self.keep_alive = keep_alive
        self.disconnected = False
        self.response_started = False
        self.response_complete = False
        self.expect_100 = expect_100
        self.queued = True  # behind another request's answer (pipelined) until begin()
        self.task: asyncio.Task[None] | None = None
        self.armed = False  # a disconnect cancels the task (inside `with cycle:`)
        self.on_response: Callable[[], None] = proto.on_response_complete
        self.on_writable: Callable[[], None] | None = None
        self._status = 0
        self._headers: list[tuple[bytes, bytes]] | None = None  # the head, held until the first body

    # -- driven by the protocol ---------------------------------------------------------------

    @property
    def message_event(self) -> HotCycle:
        """uvicorn's protocol calls `cycle.message_event.set()` on a disconnect: `set` below."""
        return self

    def set(self) -> None:
        if self.disconnected and self.armed and self.task is not None:
            self.task.cancel()

    def feed(self, data: bytes) -> None:
        """A piece of the request body (the protocol has checked the size limit)."""
        self.chunks.append(data)

    def begin(self) -> None:
        """This request is the connection's current one: start it once its body is in."""
        self.queued = False
        if not self.more_body:
            self._spawn()
        elif self.expect_100 and not self.transport.is_closing():
            self.transport.write(_CONTINUE)  # what uvicorn's first receive() sends

    def body_complete(self) -> None:
        self.more_body = False
        if not self.queued and self.task is None and not self.disconnected:
            self._spawn()

    def _spawn(self) -> None:
        proto = self.proto
        assert proto.hot_handler is not None  # a HotCycle is made only where there is one
        task = self.task = proto.loop.create_task(self._run(proto.hot_handler))
        tasks = proto.tasks  # uvicorn's graceful shutdown waits for (then cancels) these
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def _run(self, handler: HotHandler) -> None:
        """The handler answers every request itself; this only keeps a fault in it from leaving
        the connection hanging (uvicorn's `run_asgi` does the same for an ASGI app)."""
        try:
            await handler(self)
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError):  # uvicorn's shutdown cancels what outlived it
                self.proto.logger.error("Exception in the hot route's handler", exc_info=exc)
            unsent = not self.response_started or self._headers is not None
            if unsent and not self.disconnected and not isinstance(exc, asyncio.CancelledError):
                self._write(STATUS_LINE[500], [(b"content-type", _TEXT)], b"Internal Server Error")
            elif not self.response_complete:
                self.transport.close()
            if not isinstance(exc, Exception):
                raise
        finally:
            self.on_response = _nothing

    # -- what the service reads ---------------------------------------------------------------

    def request_body(self) -> bytes:
        chunks = self.chunks
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def __enter__(self) -> HotCycle:
        self.armed = True
        if self.disconnected and self.task is not None:
            self.task.cancel()  # it left before the flow began
        return self

    def __exit__(self, *exc: object) -> None:
        self.armed = False

    # -- Responder ----------------------------------------------------------------------------

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """Hold the head: it leaves with the first body bytes."""
        self.response_started = True
        self._status = status
        self._headers = headers

    async def body(self, chunk: bytes, more: bool) -> None:
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()
        self.write_chunk(chunk, more)

    # -- the relay's synchronous side ---------------------------------------------------------

    @property
    def writable(self) -> bool:
        """False while the client's socket buffer is over its high-water mark."""
        return not self.flow.write_paused

    def flush_head(self) -> None:
        """Send a held head now, as the start of a chunked body (a stream that has no bytes yet)."""
        if self._headers is not None and not self.disconnected:
            headers, self._headers = self._headers, None
            self.transport.write(self._head(self._status, headers, None))

    def write_chunk(self, chunk: bytes, more: bool = True) -> None:
        """Write `chunk` of the answer (the last one when not `more`); dropped once the client
        disconnected or the answer ended. The first write carries the held head: with
        `content-length` when it is the whole answer, else `transfer-encoding: chunked`."""
        if self.disconnected or self.response_complete:
            return
        headers = self._headers
        if headers is not None:
            self._headers = None
            if not more:
                self.transport.write(self._head(self._status, headers, len(chunk)) + chunk)
                self._finish()
                return
            out = self._head(self._status, headers, None)
            if chunk:
                out += b"%x\r\n%b\r\n" % (len(chunk), chunk)
            self.transport.write(out)
            return
        if more:
            if chunk:
                self.transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
            return
        self.transport.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(chunk), chunk) if chunk else _LAST_CHUNK)
        self._finish()

    def _finish(self) -> None:
        self.response_complete = True
        if not self.keep_alive:
            self.transport.close()
        self.on_response()

    def _write(self, status_line: bytes, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.response_started = True
        self._headers = None
        self.transport.write(self._head_from(status_line, headers, len(body)) + body)
        self._finish()

    def _head(self, status: int, headers: list[tuple[bytes, bytes]], length: int | None) -> bytes:
        return self._head_from(STATUS_LINE[status], headers, length)

    def _head_from(self, status_line: bytes, headers: list[tuple[bytes, bytes]], length: int | None) -> bytes:
        """The response head: uvicorn's default headers (`server`, `date`) first, as its `send`
        writes them, then ours (constant names; values checked where they come from a client),
        the framing, and `connection: close` when the connection ends with this answer."""
        parts = [status_line]
        for name, value in self.proto.server_state.default_headers:
            parts += (name, b": ", value, b"\r\n")
        for name, value in headers:
            parts += (name, b": ", value, b"\r\n")
        parts.append(b"transfer-encoding: chunked\r\n" if length is None else b"content-length: %d\r\n" % length)
        if not self.keep_alive:
            parts.append(b"connection: close\r\n")
        parts.append(b"\r\n")
        return b"".join(parts)


def _nothing() -> None:
    pass
