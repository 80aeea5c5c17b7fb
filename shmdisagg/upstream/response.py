"""`UpstreamResponse`: the caller's handle on one executor response, head parsed, body pending.

The rule for callers: every response must be finished one of three ways: `await read()`,
iterate it to the end, or `abort()`. Finishing returns the connection to the pool (or closes
it); until then the connection belongs to this response. A response dropped unfinished is
aborted by `__del__` as a safety net (immediate in CPython, since nothing else refers to it),
so a forgotten one closes its socket rather than poisoning the pool.

One consumer at a time: don't `read()` and iterate the same response from two tasks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from shmdisagg.upstream.errors import UpstreamDisconnected, UpstreamError

if TYPE_CHECKING:
    from shmdisagg.upstream._connection import Connection

__all__ = ["UpstreamResponse"]


class UpstreamResponse:
    """An executor's response: `status` and `headers` now, the body through `read()` or `async for`.

    Attributes:
        status: the HTTP status code.
        headers: the raw header pairs, names lower-cased, in arrival order.
    """

    __slots__ = ("status", "headers", "_conn", "_error")

    def __init__(self, conn: Connection) -> None:
        self._conn: Connection | None = conn  # None once finished: consumed, failed or aborted
        self._error: UpstreamError | None = None  # why it failed; raised again on later calls
        self.status = conn.status
        self.headers = conn.headers

    def header(self, name: bytes) -> bytes | None:
        """The first value of header `name` (lower-case bytes, e.g. b"content-type"), or None."""
        for key, value in self.headers:
            if key == name:
                return value
        return None

    @property
    def is_event_stream(self) -> bool:
        """Whether Content-Type is text/event-stream (an SSE body)."""
        ctype = self.header(b"content-type")
        return ctype is not None and ctype.lower().startswith(b"text/event-stream")

    def body(self) -> bytes:
        """The whole body of a response requested with `whole=True` (complete when it was
        returned); then the connection goes back to the pool. b"" once consumed.

        Raises:
            RuntimeError: the response is not complete (not requested with `whole`).
        """
        conn = self._conn
        if conn is None:
            if self._error is not None:
                raise self._error
            return b""
        if not conn.complete:
            raise RuntimeError("body() of a response still arriving: use read()")
        data = conn.take()
        self._conn = None
        conn.release()
        return data

    async def read(self) -> bytes:
        """The whole (de-chunked) body; then the connection goes back to the pool if keep-alive.

        Returns b"" if the body was already consumed. The body is bounded by the pool's
        `max_response_bytes`; bound the wait with `asyncio.timeout`.

        Raises:
            UpstreamDisconnected: the connection dropped before the body ended, or the response
                was aborted.
            UpstreamProtocolError: malformed framing or a body over `max_response_bytes`.
            asyncio.CancelledError: re-raised after the connection is closed.
        """
        conn = self._conn
        if conn is None:
            if self._error is not None:
                raise self._error
            return b""
        if not conn.complete and conn.error is None:
            conn.collect = True
            if conn.paused:
                conn.resume()
            while not conn.complete and conn.error is None:
                try:
                    await conn.wait()
                except BaseException:
                    self.abort()
                    raise
                if self._conn is None:  # aborted meanwhile
                    raise self._error or UpstreamDisconnected("response was aborted", conn.rx_bytes)
        if conn.error is not None:
            raise self._fail(conn, conn.error)
        data = conn.take()
        self._conn = None
        conn.release()
        return data

    def __aiter__(self) -> UpstreamResponse:
        return self

    async def __anext__(self) -> bytes:
        """The body bytes buffered since the last call, joined: one received chunk when the consumer
        keeps up, several when it fell behind; never split. After the last bytes the connection
        goes back to the pool.

        Raises:
            StopAsyncIteration: the body ended.
            UpstreamDisconnected, UpstreamProtocolError: as `read()`, after any bytes that arrived
                before the failure were yielded.
            asyncio.CancelledError: re-raised after the connection is closed.
        """
        conn = self._conn
        if conn is None:
            if self._error is not None:
                raise self._error
            raise StopAsyncIteration
        while not conn.chunks:
            if conn.error is not None:
                raise self._fail(conn, conn.error)
            if conn.complete:
                self._conn = None
                conn.release()
                raise StopAsyncIteration
            try:
                await conn.wait()
            except BaseException:
                self.abort()
                raise
            if self._conn is None:  # aborted meanwhile
                raise self._error or UpstreamDisconnected("response was aborted", conn.rx_bytes)
        data = conn.take()
        if conn.complete:
            self._conn = None
            conn.release()
        return data

    def pipe(self, sink: Callable[[bytes], None]) -> Awaitable[None]:
        """Hand the body to `sink` as it arrives, called from the connection's read callback
        (the pieces of one read joined; no task wakes up per piece); await the result to wait
        for the end, after which the connection goes back to the pool. The body buffered so far
        is handed over here, before this returns. The consumer of a slow client pauses the
        executor's socket with `pause_reading` and resumes it with `resume_reading`.

        Raises (here, or from the awaitable):
            UpstreamDisconnected, UpstreamProtocolError, UpstreamTimeout: as `read()`.
            Exception: whatever `sink` raised (the connection is closed then).
            asyncio.CancelledError: re-raised after the connection is closed.
        """
        conn = self._conn
        if conn is None:
            return self._finished()
        try:
            fut = conn.pipe(sink)
        except BaseException:
            self.abort()
            raise
        return self._piped(conn, fut)

    async def _finished(self) -> None:
        if self._error is not None:
            raise self._error

    async def _piped(self, conn: Connection, fut: asyncio.Future[None]) -> None:
        try:
            await fut
        except UpstreamError as err:
            raise self._fail(conn, err) from None
        except BaseException:
            self.abort()
            raise
        self._conn = None
        conn.release()

    def pause_reading(self) -> None:
        """Stop reading the executor's socket (its sender then blocks on a full window)."""
        conn = self._conn
        if conn is not None and not conn.paused and not conn.closed and conn.transport is not None:
            conn.paused = True
            conn.transport.pause_reading()

    def resume_reading(self) -> None:
        conn = self._conn
        if conn is not None and conn.paused:
            conn.resume()

    def abort(self) -> None:
        """Close the connection now (client went away, cancellation). Idempotent; a no-op once the
        body was consumed, since the connection may already serve another request."""
        conn = self._conn
        if conn is not None:
            self._conn = None
            self._error = UpstreamDisconnected("response was aborted", conn.rx_bytes)
            conn.abort("response was aborted")

    def _fail(self, conn: Connection, error: UpstreamError) -> UpstreamError:
        """Finish as failed: close the connection, remember `error` for later calls, return it."""
        self._error = error
        self._conn = None
        conn.close()
        return error

    def __del__(self) -> None:
        conn = self._conn
        if conn is not None:
            self._conn = None
            try:
                conn.abort("response was dropped unfinished")
            except Exception:  # the loop may already be closed at interpreter exit
                pass

    def __repr__(self) -> str:
        state = "open" if self._conn is not None else ("failed" if self._error is not None else "done")
        return f"<UpstreamResponse {self.status} {state}>"
