"""`UpstreamPool`: keep-alive HTTP/1.1 connections to executors, one idle stack per (host, port).

Owns every connection it opened and the per-host request-head cache. Never parses a response
(that is `_connection.Connection`) and never decides where a request goes (the caller picks
host and port). One pool serves one event loop; it binds to the loop of its first request.

Why these defaults: idle connections are reused newest first (LIFO, so the oldest age out) and
never after `idle_timeout_s`, which stays below the executors' keep-alive (uvicorn closes after
5 s) so that a reused socket is rarely one the server is closing; the rare race that remains
is retried once on a fresh connection, as TensorRT-LLM's client does with its 1 s keep-alive.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from shmdisagg.hostport import authority
from shmdisagg.upstream._connection import Connection, StaleConnection
from shmdisagg.upstream.errors import UpstreamConnectError, UpstreamDisconnected
from shmdisagg.upstream.response import UpstreamResponse

__all__ = ["Body", "UpstreamPool"]

# A request body: one buffer, or its pieces in order (a long prompt's bytes left in the client's
# body, `orchestrator/splice.py`), written with one `writelines` so that no piece is copied into
# a joined buffer (uvloop sends them with one vectored write).
Body = bytes | list[bytes | memoryview]

# Methods whose empty body is sent without a Content-Length header.
_BODYLESS = frozenset({"GET", "HEAD"})
# Distinct (method, path) heads cached per host; past this, heads are built per request.
_MAX_CACHED_HEADS = 256


class _Host:
    """One executor address: its idle stack (oldest first) and cached request heads.

    heads: (method, path) -> b"METHOD path HTTP/1.1\\r\\nhost: authority\\r\\n".
    """

    __slots__ = ("host", "port", "authority", "idle", "heads", "_host_line")

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self.authority = authority(host, port)
        self.idle: list[Connection] = []
        self.heads: dict[tuple[str, str], bytes] = {}
        self._host_line = f"host: {self.authority}\r\n".encode("ascii")

    def encode(self, method: str, path: str, body: Body, headers: Sequence[tuple[bytes, bytes]]) -> Body:
        """The request: head, caller headers, Content-Length, blank line, body; one buffer, or
        the head joined and then the pieces of a body given as pieces."""
        head = self.heads.get((method, path))
        if head is None:
            head = self._head(method, path)
        parts = [head]
        for name, value in headers:
            parts += (name, b": ", value, b"\r\n")
        if isinstance(body, bytes):
            bodyless = not body and method in _BODYLESS
            parts += (b"\r\n" if bodyless else b"content-length: %d\r\n\r\n" % len(body), body)
            return b"".join(parts)
        parts.append(b"content-length: %d\r\n\r\n" % sum(len(piece) for piece in body))
        return [b"".join(parts), *body]

    def _head(self, method: str, path: str) -> bytes:
        if not method.isalpha() or not path.startswith("/") or any(c in path for c in " \r\n"):
            raise ValueError(f"bad request line: {method!r} {path!r}")
        head = f"{method} {path} HTTP/1.1\r\n".encode("latin-1") + self._host_line
        if len(self.heads) < _MAX_CACHED_HEADS:
            self.heads[(method, path)] = head
        return head


class UpstreamPool:
    """Pooled keep-alive HTTP/1.1 client for executors (asyncio.Protocol + httptools).

    Args:
        max_idle_per_host: idle connections kept per (host, port); more are closed on release.
            Concurrency is not capped: a request with no idle connection opens a new one.
        idle_timeout_s: an idle connection is never reused after this many seconds, and a timer
            closes it then. Keep it below the executors' keep-alive (uvicorn: 5 s).
        connect_timeout_s: bound on opening a TCP connection, seconds.
        max_response_bytes: bound on one response body, bytes; more fails the response with
            `UpstreamProtocolError`.
        read_high_water_bytes: when this many body bytes wait for a slow consumer of
            `async for`, reading from the socket pauses until the consumer takes them.

    Attributes:
        connects: connections opened so far.
        stale_retries: requests replayed on a fresh connection after the keep-alive race.

    Raises:
        ValueError: a limit is not positive.
    """

    def __init__(
        self,
        *,
        max_idle_per_host: int = 256,
        idle_timeout_s: float = 4.0,
        connect_timeout_s: float = 5.0,
        max_response_bytes: int = 256 << 20,
        read_high_water_bytes: int = 64 << 10,
    ) -> None:
        for name, value in (
            ("max_idle_per_host", max_idle_per_host),
            ("idle_timeout_s", idle_timeout_s),
            ("connect_timeout_s", connect_timeout_s),
            ("max_response_bytes", max_response_bytes),
            ("read_high_water_bytes", read_high_water_bytes),
        ):
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value!r}")
        # per-pool settings
        self.max_idle_per_host = max_idle_per_host
        self.idle_timeout_s = idle_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_response_bytes = max_response_bytes
        self.read_high_water_bytes = read_high_water_bytes
        # per-pool state
        self.connects = 0
        self.stale_retries = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._hosts: dict[tuple[str, int], _Host] = {}
        self._conns: set[Connection] = set()  # every connection not yet lost
        self._sweeper: asyncio.TimerHandle | None = None
        self._closed = False
        self._drained: asyncio.Future[None] | None = None

    async def request(
        self,
        host: str,
        port: int,
        method: str,
        path: str,
        body: Body = b"",
        *,
        headers: Sequence[tuple[bytes, bytes]] = (),
        timeout_s: float | None = None,
        whole: bool = False,
        total: bool = False,
    ) -> UpstreamResponse:
        """Send one request and return as soon as the response status line and headers are parsed
        (with `whole`, once the whole response is in: `UpstreamResponse.body()` has it).

        The body follows through the response: `read()`, `async for`, or `abort()`; one of them
        must be used (see `UpstreamResponse`). A reused connection that turns out closed by the
        executor before any response byte arrived is replayed once on a fresh connection (the
        keep-alive race); nothing is replayed once a response byte was received. If that replay
        cannot connect, `UpstreamConnectError` is raised: the first attempt got no byte back and
        is presumed unprocessed, which is the premise of the replay itself.

        Args:
            host, port: the executor.
            method, path: request line, e.g. "POST", "/v1/completions".
            body: sent with Content-Length in the same write as the head; a list of pieces is
                sent as they are (`Body`), with one vectored write.
            headers: extra raw header pairs (no Host or Content-Length; no CR/LF inside).
            timeout_s: bound on the whole exchange up to the parsed head (connect included),
                seconds; None for no bound. With `whole` or `total` it bounds the body too (a body
                past it fails with `UpstreamTimeout`, from here or from the response's reads);
                else bound the body with `asyncio.timeout`.
            whole: return once the response is complete, its body collected.
            total: `timeout_s` bounds the body, read as it comes (a stream), too.

        Raises:
            UpstreamConnectError: refused, unresolvable, connect timed out, or the pool is closed;
                nothing was sent.
            UpstreamDisconnected: the connection dropped after the request was written.
            UpstreamTimeout: `timeout_s` passed before the head arrived (with `whole`, before the
                response was complete); the connection is closed.
            UpstreamProtocolError: the executor's response head was malformed or too large.
            ValueError: a malformed method or path.
        """
        if self._closed:
            raise UpstreamConnectError("upstream pool is closed")
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        h = self._hosts.get((host, port))
        if h is None:
            h = self._hosts[(host, port)] = _Host(host, port)
        data = h.encode(method, path, body, headers)
        no_body = method == "HEAD"
        deadline = None if timeout_s is None else loop.time() + timeout_s
        conn = self._pop_idle(h, loop)
        while True:
            if conn is None:
                conn = await self._connect(h, loop, deadline)
            fut = conn.start(data, no_body, deadline, whole, total)
            try:
                await fut
            except StaleConnection:
                if conn.served == 0:  # pragma: no cover -- a fresh connection is never stale
                    raise UpstreamDisconnected(f"{h.authority} closed a fresh connection", 0) from None
                self.stale_retries += 1
                conn = None
                continue
            except BaseException:
                conn.abort("request was cancelled or failed")
                raise
            return UpstreamResponse(conn)

    async def close(self) -> None:
        """Close every connection and wait until they are gone; responses still in flight fail
        with `UpstreamDisconnected`. Later requests raise `UpstreamConnectError`. Idempotent."""
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for h in self._hosts.values():
            for conn in h.idle:
                conn.pooled = False
                conn.close()
            h.idle.clear()
        for conn in list(self._conns):
            if conn.busy:
                conn.abort("upstream pool closed")
            else:
                conn.close()
        if self._conns and self._loop is not None:
            if self._drained is None:
                self._drained = self._loop.create_future()
            await asyncio.shield(self._drained)  # shared by concurrent close() calls

    async def __aenter__(self) -> UpstreamPool:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def idle_count(self, host: str, port: int) -> int:
        """Idle connections pooled for (host, port) now."""
        h = self._hosts.get((host, port))
        return len(h.idle) if h is not None else 0

    @property
    def open_count(self) -> int:
        """Connections open now, idle or busy."""
        return len(self._conns)

    # -- connections ----------------------------------------------------------------------

    def _pop_idle(self, h: _Host, loop: asyncio.AbstractEventLoop) -> Connection | None:
        idle = h.idle
        while idle:
            conn = idle.pop()
            conn.pooled = False
            if conn.closed:  # failed while idle; its connection_lost has not run yet
                continue
            if loop.time() - conn.idle_since < self.idle_timeout_s:
                return conn
            # The newest is too old, so are all below it.
            conn.close()
            for old in idle:
                old.pooled = False
                old.close()
            idle.clear()
        return None

    async def _connect(self, h: _Host, loop: asyncio.AbstractEventLoop, deadline: float | None) -> Connection:
        timeout = self.connect_timeout_s
        if deadline is not None:
            timeout = min(timeout, deadline - loop.time())
        conn = Connection(self, h, loop)
        try:
            async with asyncio.timeout(timeout):
                await loop.create_connection(lambda: conn, h.host, h.port)
        except TimeoutError as exc:
            raise UpstreamConnectError(f"connect to {h.authority} timed out after {timeout:.3f} s") from exc
        except OSError as exc:
            raise UpstreamConnectError(f"connect to {h.authority} failed: {exc}") from exc
        self.connects += 1
        if self._closed:
            conn.close()
            raise UpstreamConnectError("upstream pool is closed")
        return conn

    def _on_conn_made(self, conn: Connection) -> None:
        self._conns.add(conn)

    def _on_conn_lost(self, conn: Connection) -> None:
        self._conns.discard(conn)
        if conn.pooled:  # the executor closed an idle connection
            conn.pooled = False
            conn.host.idle.remove(conn)
        if self._drained is not None and not self._conns and not self._drained.done():
            self._drained.set_result(None)

    def _put_idle(self, conn: Connection) -> None:
        idle = conn.host.idle
        if self._closed or len(idle) >= self.max_idle_per_host:
            conn.close()
            return
        loop = conn.loop
        conn.idle_since = loop.time()
        conn.pooled = True
        idle.append(conn)
        if self._sweeper is None:
            # Later connections expire later, so the first expiry is always this one's.
            self._sweeper = loop.call_at(conn.idle_since + self.idle_timeout_s, self._sweep)

    def _sweep(self) -> None:
        """Close connections idle for `idle_timeout_s`; re-arm for the next one to expire."""
        self._sweeper = None
        loop = self._loop
        if loop is None:  # pragma: no cover -- armed only after a request bound the loop
            return
        # A timer may fire up to the clock's resolution early: allow a millisecond.
        cutoff = loop.time() + 1e-3 - self.idle_timeout_s
        next_since: float | None = None
        for h in self._hosts.values():
            idle = h.idle
            n = 0
            while n < len(idle) and idle[n].idle_since <= cutoff:
                n += 1
            if n:
                old = idle[:n]
                del idle[:n]
                for conn in old:
                    conn.pooled = False
                    conn.close()
            if idle and (next_since is None or idle[0].idle_since < next_since):
                next_since = idle[0].idle_since
        if next_since is not None:
            self._sweeper = loop.call_at(next_since + self.idle_timeout_s, self._sweep)
