"""Minimal ASGI helpers for the two hot routes: read a bounded body, send bytes, watch for a
client disconnect; and `Responder`, the two calls an answer is written through, so a flow does
not care whether it answers an ASGI `send` (`AsgiResponder`: the Anthropic adapter, the observed
path, tests) or the public port's connection itself (`fleet/hot.py`). No framework objects are
built on the hot path."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Protocol

from shmdisagg.orchestrator.errors import RequestError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

JSON_HEADERS = [(b"content-type", b"application/json")]
# Starlette's StreamingResponse(media_type="text/event-stream"), which TensorRT-LLM's servers
# answer streams with, adds the charset to a text/ type
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


class Responder(Protocol):
    """Where one answer goes: `start` once, then `body` until `more` is False.

    `start` may hold the head back until the first `body` (so a complete answer leaves in one
    write, with its length); `body` returns once the bytes are handed to the transport, after
    waiting while the client's socket is not writable.

    A `direct` responder also writes synchronously, from a callback: `write_chunk(chunk)` (a piece
    of a streamed answer), `writable` (False while the client's socket is full) and
    `on_writable` (called once it drains), which a relayed stream uses (`flows._Pipe`)."""

    direct: bool
    on_writable: Callable[[], None] | None

    @property
    def writable(self) -> bool: ...

    def write_chunk(self, chunk: bytes, more: bool = True) -> None: ...

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None: ...

    async def body(self, chunk: bytes, more: bool) -> None: ...

    def flush_head(self) -> None:
        """Send a held head now (a stream whose first bytes may be a while)."""


class AsgiResponder:
    """A `Responder` over an ASGI `send` (two messages per answer); not `direct`."""

    __slots__ = ("send", "on_writable")
    direct = False
    writable = True

    def __init__(self, send: Send) -> None:
        self.send = send
        self.on_writable: Callable[[], None] | None = None

    def write_chunk(self, chunk: bytes, more: bool = True) -> None:
        raise RuntimeError("an ASGI answer is written through body()")

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        await self.send({"type": "http.response.start", "status": status, "headers": headers})

    async def body(self, chunk: bytes, more: bool) -> None:
        await self.send({"type": "http.response.body", "body": chunk, "more_body": more})

    def flush_head(self) -> None:
        """Nothing to do: the ASGI server sends the head at `http.response.start`."""


class ClientDisconnected(Exception):
    """The client went away before the response ended."""


async def read_body(receive: Receive, limit: int) -> bytes:
    """The whole request body. Raises `RequestError(413)` past `limit` bytes and
    `ClientDisconnected` if the client leaves first."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise RequestError(413, f"request body is larger than {limit} bytes", "request_too_large")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def send_bytes(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] = JSON_HEADERS) -> None:
    """A complete response in two ASGI messages."""
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class DisconnectWatch:
    """Cancels the request's task when the client disconnects.

    After the body is read, the next `receive()` returns only on disconnect; waiting for it in a
    side task is how an ASGI app learns that the client left while it is awaiting an executor.
    Use as a context manager around the part of a flow that waits on executors.
    """

    __slots__ = ("_receive", "_watch", "_task", "disconnected")

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._watch: asyncio.Task[Message] | None = None
        self._task: asyncio.Task[Any] | None = None
        self.disconnected = False

    def __enter__(self) -> DisconnectWatch:
        self._task = asyncio.current_task()
        self._watch = asyncio.ensure_future(self._receive())
        self._watch.add_done_callback(self._on_message)
        return self

    def _on_message(self, fut: asyncio.Future[Message]) -> None:
        if fut.cancelled() or fut.exception() is not None:
            return
        if fut.result().get("type") == "http.disconnect" and self._task is not None:
            self.disconnected = True
            self._task.cancel()

    def __exit__(self, *exc: object) -> None:
        self._task = None
        if self._watch is not None and not self._watch.done():
            self._watch.remove_done_callback(self._on_message)
            self._watch.cancel()
