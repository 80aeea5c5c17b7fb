"""A loopback HTTP/1.1 client that sees every way a response can end.

Raw asyncio streams with httptools' response parser (a project dependency) rather than aiohttp:
the chaos checks must tell apart a reset before any byte, a body cut after the head, a stream cut
without an error event and a malformed body, know when each connection was opened (a cut is
forgiven only on a connection that may have reached a killed process), and send requests
byte by byte or leave at any point. aiohttp folds several of these into one exception and
retries nothing we could observe.

`classify` is a pure function: the bytes of one exchange to an `Outcome`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import httptools
import orjson

# Outcome kinds. COMPLETE and ERROR are answers; CUT is a connection that ended without one
# (judged by the scenario: allowed only where a process on its path was killed); the rest are
# violations everywhere.
COMPLETE = "complete"  # a full answer: JSON with choices, or chunks then [DONE] with no error event
ERROR = "error"  # a clean error: an HTTP status with the OpenAI error body, or an SSE error event then [DONE]
CUT = "cut"  # reset or EOF before the answer was complete
TIMEOUT = "timeout"  # no complete answer by the client's deadline
MALFORMED = "malformed"  # an answer that breaks the protocol (bad JSON, bad error body, bytes after [DONE], ...)
REFUSED = "refused"  # the public port refused the connection: no fleet worker listened
ABANDONED = "abandoned"  # the client left on purpose (scenario 5): nothing was owed

FLEET_CATCH_ALL = "internal error"  # service.py's message for an exception in the worker: a bug, never clean


@dataclass
class Outcome:
    """One request as the client saw it. Times are `time.monotonic()` seconds."""

    kind: str
    detail: str = ""
    status: int | None = None  # the HTTP status; for a stream's error event, the error's code
    stream: bool = False
    path: str = ""
    started: float = 0.0
    ended: float = 0.0
    conn_opened: float = 0.0  # when the connection this request went on was opened
    request_id: int | None = None  # x-disagg-request-id
    user: str = ""

    @property
    def elapsed(self) -> float:
        return self.ended - self.started


@dataclass
class Exchange:
    """The bytes of one response as they arrive (httptools callbacks)."""

    head: bool = False
    done: bool = False
    status: int | None = None
    headers: dict[bytes, bytes] = field(default_factory=dict)
    body: bytearray = field(default_factory=bytearray)
    received: int = 0  # bytes read from the socket, head included

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        self.head = True

    def on_body(self, chunk: bytes) -> None:
        self.body += chunk

    def on_message_complete(self) -> None:
        self.done = True

    @property
    def events(self) -> int:
        """SSE events received so far (for leaving mid-stream)."""
        return self.body.count(b"\n\n")


def request_bytes(port: int, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[bytes, bytes]:
    """(head, body) of a POST with a JSON body."""
    lines = [
        f"POST {path} HTTP/1.1",
        f"Host: 127.0.0.1:{port}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
    ]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode(), body


class Connection:
    """One client connection; `opened` is when its connect() was called (monotonic): the kernel
    may complete the handshake, into a listener about to die, before this thread runs again."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, opened: float) -> None:
        self.reader, self.writer, self.opened = reader, writer, opened
        self.reusable = True

    @classmethod
    async def open(cls, port: int, rcvbuf: int | None = None) -> Connection:
        """Raises ConnectionRefusedError (and other OSErrors) as `asyncio.open_connection` does.
        `rcvbuf`: a small receive buffer, so that a slow reader really holds the server back."""
        opened = time.monotonic()
        if rcvbuf is None:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        else:
            import socket

            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
            reader, writer = await asyncio.open_connection(sock=sock, limit=rcvbuf)
        return cls(reader, writer, opened)

    def close(self, reset: bool = True) -> None:
        """`reset`: abort (RST; nothing to wait for, the server sees the close at once), else a
        plain close (FIN after what is buffered)."""
        self.reusable = False
        if reset:
            self.writer.transport.abort()
        else:
            self.writer.close()

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def read_response(
        self, ex: Exchange, *, chunk: int = 65536, until_events: int | None = None, pause_s: float = 0.0
    ) -> None:
        """Feed `ex` until the message is complete (or, with `until_events`, until that many SSE
        events arrived). `pause_s` between reads of `chunk` bytes makes a slow reader. Raises
        ConnectionError / asyncio.IncompleteReadError-free: an EOF returns with `ex.done` False;
        a malformed response raises httptools.HttpParserError."""
        parser = httptools.HttpResponseParser(ex)
        while not ex.done:
            data = await self.reader.read(chunk)
            if not data:
                self.reusable = False
                return
            ex.received += len(data)
            parser.feed_data(data)
            if ex.head and ex.status is None:
                ex.status = parser.get_status_code()
            if until_events is not None and ex.events >= until_events:
                return
            if pause_s:
                await asyncio.sleep(pause_s)
        if ex.status is None:
            ex.status = parser.get_status_code()
        if not parser.should_keep_alive():
            self.reusable = False


def classify(stream: bool, ex: Exchange) -> tuple[str, str, int | None]:
    """(kind, detail, status) of a finished or cut exchange: see the kinds above."""
    if not ex.done:
        if not ex.received:
            return CUT, "no response byte", None
        if not ex.head:
            return CUT, f"cut in the response head after {ex.received} bytes", None
        if ex.status == 200 and stream:
            return CUT, f"stream cut after {ex.events} events without [DONE]", ex.status
        return CUT, f"body cut after {len(ex.body)} bytes (HTTP {ex.status})", ex.status
    status = ex.status
    assert status is not None
    if status != 200:
        problem = _error_object_problem(_json(ex.body), status)
        return (
            (MALFORMED, f"HTTP {status} error body: {problem}", status)
            if problem
            else (ERROR, f"HTTP {status}", status)
        )
    ctype = ex.headers.get(b"content-type", b"")
    if not stream:
        doc = _json(ex.body)
        if not ctype.startswith(b"application/json") or not isinstance(doc, dict) or not _has_choices(doc):
            return MALFORMED, f"200 without a JSON answer with choices: {bytes(ex.body[:120])!r}", status
        return COMPLETE, "", status
    if not ctype.startswith(b"text/event-stream"):
        return MALFORMED, f"a stream answered with content-type {ctype!r}", status
    return _classify_sse(bytes(ex.body))


def _classify_sse(body: bytes) -> tuple[str, str, int | None]:
    datas = [
        line[6:]
        for event in body.split(b"\n\n")
        if event.strip()
        for line in event.split(b"\n")
        if line.startswith(b"data: ")
    ]
    if not datas or datas[-1] != b"[DONE]":
        return MALFORMED, f"stream without a final [DONE] ({len(datas)} events)", 200
    if datas.count(b"[DONE]") != 1:
        return MALFORMED, "[DONE] twice", 200
    chunks = []
    for raw in datas[:-1]:
        doc = _json(raw)
        if not isinstance(doc, dict):
            return MALFORMED, f"SSE data that is not a JSON object: {raw[:120]!r}", 200
        chunks.append(doc)
    errors = [c for c in chunks if "error" in c]
    if errors:
        err = errors[0]["error"]
        code = err.get("code") if isinstance(err, dict) else None
        problem = _error_object_problem(err, code if isinstance(code, int) else -1)
        if problem:
            return MALFORMED, f"SSE error event: {problem}", 200
        if chunks[-1] is not errors[0]:
            return MALFORMED, "chunks after the SSE error event", 200
        return ERROR, f"SSE error {code} after {len(chunks) - 1} chunks", code
    if not any(_has_choices(c) for c in chunks):
        return MALFORMED, "a stream with no chunk carrying choices", 200
    return COMPLETE, "", 200


def _json(raw: bytes | bytearray) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None


def _has_choices(doc: dict[str, Any]) -> bool:
    choices = doc.get("choices")
    return isinstance(choices, list) and bool(choices)


def _error_object_problem(err: Any, status: int) -> str | None:
    """None if `err` is TensorRT-LLM's ErrorResponse for `status`, else what is wrong with it."""
    if not isinstance(err, dict):
        return f"not a JSON object: {str(err)[:120]!r}"
    if err.get("object") != "error" or not isinstance(err.get("message"), str) or not isinstance(err.get("type"), str):
        return f"not an ErrorResponse: {orjson.dumps(err)[:160]!r}"
    if err.get("code") != status:
        return f"code {err.get('code')!r} is not the status {status}"
    if err["message"] == FLEET_CATCH_ALL:
        return "the fleet's catch-all 500 (an exception in the worker)"
    return None


async def exchange(conn: Connection, head: bytes, body: bytes, stream: bool, deadline: float, **read: Any) -> Outcome:
    """Send one request on `conn` and read its answer by `deadline` (monotonic). The caller
    closes `conn` unless it is still `reusable`."""
    out = Outcome(TIMEOUT, stream=stream, started=time.monotonic(), conn_opened=conn.opened)
    ex = Exchange()
    try:
        async with asyncio.timeout_at(_loop_deadline(deadline)):
            await conn.send(head + body)
            await conn.read_response(ex, **read)
        out.kind, out.detail, out.status = classify(stream, ex)
    except TimeoutError:
        out.detail = f"no complete answer within {deadline - out.started:.1f} s ({ex.received} bytes received)"
        conn.reusable = False
    except (ConnectionError, OSError) as err:
        out.kind, out.detail, out.status = classify(stream, ex)
        out.detail = f"{type(err).__name__}: {out.detail}"
        conn.reusable = False
    except httptools.HttpParserError as err:
        out.kind, out.detail = MALFORMED, f"unparsable HTTP response: {err}"
        conn.reusable = False
    out.ended = time.monotonic()
    rid = ex.headers.get(b"x-disagg-request-id")
    out.request_id = int(rid) if rid and rid.isdigit() else None
    return out


def _loop_deadline(deadline: float) -> float:
    """A monotonic deadline as the running loop's clock (both are CLOCK_MONOTONIC in CPython, but
    do not rely on it)."""
    return asyncio.get_running_loop().time() + (deadline - time.monotonic())
