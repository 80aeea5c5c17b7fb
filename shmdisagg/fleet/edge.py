"""Connection hygiene at the public port: uvicorn's httptools protocol with deadlines, size limits
and a connection cap, every refusal in TensorRT-LLM's `ErrorResponse` shape.

`EdgeProtocol` is `uvicorn.protocols.http.httptools_impl.HttpToolsProtocol` plus, per connection
(the settings are the config's `shmdisagg:` keys, `EdgeLimits.for_worker`):

- the request head must arrive within `client_header_timeout_s`, counted from the connection's
  opening for its first request and from the first byte of each later one (nginx's
  `client_header_timeout`: the whole head); a head that has begun gets a 408, a new connection
  that never sent a byte is closed without an answer (nginx does the same: a pooled client that
  sends its request as an unsolicited 408 arrives would take the 408 for its answer);
- the whole body must arrive within `client_body_timeout_s` of the head's end, else a 408 (nginx's
  `client_body_timeout` times each read instead; one deadline for the whole body also stops a
  body that drips a byte at a time);
- a declared `Content-Length` over `max_request_body_bytes` (the limit the hot routes already
  enforce, `asgi.read_body`) is answered 413 once the head is parsed, the body unread; a chunked
  body is answered 413 as soon as it passes the limit;
- a head larger than `MAX_HEAD_BYTES` (envoy's `max_request_headers_kb` default, 60 KiB, rounded
  up; httptools itself has no limit) is answered 431: a head that came in a read larger than the
  limit or over several reads is measured at its end (its parsed target, names and values); one
  still arriving is refused once its reads after the first pass the limit (a header line that
  never ends is never parsed);
- a connection beyond `worker_connections` open ones is answered 503 with `Retry-After: 1`;
- a keep-alive connection idle for `server_keep_alive_timeout` is closed (uvicorn's
  `timeout_keep_alive`, kept on this protocol's own timer);
- whatever httptools cannot parse (a bad request line, header, chunk size, an HTTP/2 preface, a
  TLS handshake, an upgrade with a body) is answered 400 naming the parser's reason, or the
  protocol the client spoke (HTTP/2, TLS), never the input.

TensorRT-LLM's orchestrator has none of these: it serves with a plain `uvicorn.Config` given only
`timeout_keep_alive` (`tensorrt_llm/serve/openai_disagg_server.py` `__call__`, @01edceae, file id
56985424023), so its defaults come from the servers named above.

Requests parsed whole before the refused bytes (pipelined in the same write, or sent while a slow
response ran) are answered first, in order; the refusal comes after their answers. Every refusal
carries `Connection: close`; then the connection lingers (`LINGER_S`, nginx's
`lingering_close`): the write side is shut, what the client still sends is read and dropped until
it closes, so the answer is not lost to a reset while the client is still sending.

Timers: one `TimerHandle` per connection, on the loop clock. The connection's deadline is a float
(`_deadline`), set when a phase starts that has one: a head or a body left incomplete by a read
(set after the read, on the same loop time, so a request that arrives whole in one read sets
none), an idle keep-alive connection. The timer is armed at the opening and moved only when a
deadline comes before it; when it fires before the present deadline it follows it, when it fires
on a stale one it does nothing. So a keep-alive connection's steady state costs no timer
operation per request (uvicorn arms and cancels its keep-alive timer on every request):
`benchmarks/bench_edge.py` counts what the protocol adds per request (BENCHMARKS.md).
"""

from __future__ import annotations

import asyncio
import logging
import resource
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import httptools
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle

from shmdisagg.anthropic.protocol import PATHS as ANTHROPIC_PATHS, error_envelope
from shmdisagg.fleet.hot import HOT_TARGETS, HotCycle, HotHandler
from shmdisagg.orchestrator.errors import error_body

if TYPE_CHECKING:
    from shmdisagg.config import DisaggConfig

log = logging.getLogger("shmdisagg.fleet")
# The Anthropic adapter's routes (fleet/app.py): their refusals here come in its envelope too.
ANTHROPIC_TARGETS = frozenset(path.encode() for path in ANTHROPIC_PATHS)

MAX_HEAD_BYTES = 64 << 10
# How long a refused connection is drained before it is closed (nginx: lingering_timeout 5 s,
# lingering_time 30 s; shorter here, a refused connection holds a file descriptor meanwhile).
LINGER_S = 2.0
# File descriptors a client connection may need: its socket and the executor connection of its
# request in flight (a leg; the legs of one request run one after the other or share the pool).
FDS_PER_CONNECTION = 2
# Descriptors kept for everything else: the listener, the event loop's, the shared-memory and
# metrics segments, the coordinator sockets, log and trace files, idle pooled executor
# connections beyond the client connections' own.
FD_RESERVE = 256

# The connection's phase; its deadline is `_deadline` (0.0: none). `_BODY` lasts from the end of a
# head to the end of its response: the body is complete once uvicorn's `cycle.more_body` is false.
_HEAD, _BODY, _OPEN, _IDLE, _LINGER = range(5)

_base_headers_complete = HttpToolsProtocol.on_headers_complete
_base_response_complete = HttpToolsProtocol.on_response_complete


@dataclass(frozen=True)
class EdgeLimits:
    """A fleet worker's limits at its public port. Times in seconds, sizes in bytes."""

    client_header_timeout_s: float
    client_body_timeout_s: float
    max_request_body_bytes: int
    worker_connections: int

    @classmethod
    def for_worker(cls, config: DisaggConfig) -> EdgeLimits:
        """The config's limits, `worker_connections` clamped to what `RLIMIT_NOFILE` allows after
        raising its soft limit to the hard one (both logged; a clamp is a warning)."""
        section = config.shmdisagg
        before, soft, hard = raise_nofile_limit()
        log.info("RLIMIT_NOFILE: soft limit %s (was %s), hard limit %s", _show(soft), _show(before), _show(hard))
        cap = fit_connections(section.worker_connections, soft)
        if cap < section.worker_connections:
            log.warning(
                "shmdisagg.worker_connections %d does not fit under RLIMIT_NOFILE %d (%d descriptors per connection, "
                "%d kept for the rest): at most %d connections per worker; raise the hard limit (ulimit -Hn, "
                "LimitNOFILE=) or lower the setting",
                section.worker_connections,
                soft,
                FDS_PER_CONNECTION,
                FD_RESERVE,
                cap,
            )
        return cls(section.client_header_timeout_s, section.client_body_timeout_s, section.max_request_body_bytes, cap)


def _show(limit: int) -> int | str:
    return "unlimited" if limit == resource.RLIM_INFINITY else limit


def raise_nofile_limit() -> tuple[int, int, int]:
    """Raise this process's soft `RLIMIT_NOFILE` to its hard limit (2**20 if that is unlimited,
    Linux's default `fs.nr_open`). Returns (soft before, soft now, hard)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return soft, target, hard
        except (ValueError, OSError) as err:
            log.warning("could not raise RLIMIT_NOFILE from %d to %d: %s", soft, target, err)
    return soft, soft, hard


def fit_connections(wanted: int, nofile: int) -> int:
    """`wanted` client connections, or fewer if they do not fit in `nofile` descriptors with
    `FDS_PER_CONNECTION` each and `FD_RESERVE` kept (at least one)."""
    if nofile == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, (nofile - FD_RESERVE) // FDS_PER_CONNECTION))


def _is_tls_record(data: bytes) -> bool:
    """Whether `data` opens with a TLS handshake record's header: content type 22, version 3.x
    (a ClientHello's record says 3.1 or 3.3 whatever version it offers, RFC 8446 5.1; SSL 3.0's
    said 3.0). No HTTP method begins so, so it is only looked for once the parser has refused a read."""
    return data[:2] == b"\x16\x03" and data[2:3] < b"\x10"


def edge_protocol(
    limits: EdgeLimits, hot: HotHandler | None = None, refused: Callable[[], None] | None = None
) -> type[EdgeProtocol]:
    """The protocol class to pass as `uvicorn.Config(http=...)`, with `limits` bound; with `hot`,
    the two hot routes are served as `HotCycle`s run by it (`fleet/hot.py`), not through ASGI;
    `refused()` is called for each request the port refuses itself (`_refuse`)."""
    return type(
        "EdgeProtocol",
        (EdgeProtocol,),
        {
            "hot_handler": None if hot is None else staticmethod(hot),
            "on_refused": None if refused is None else staticmethod(refused),
            "limits": limits,
            "head_timeout_s": limits.client_header_timeout_s,
            "body_timeout_s": limits.client_body_timeout_s,
            "max_body": limits.max_request_body_bytes,
            "max_body_digits": len(str(limits.max_request_body_bytes)),
            "max_connections": limits.worker_connections,
        },
    )


class _Refusal(Exception):
    """Raised in a parser callback to stop parsing and answer `status` (httptools re-raises it as
    the `__context__` of an `HttpParserCallbackError`)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class EdgeProtocol(HttpToolsProtocol):
    """`HttpToolsProtocol` with the public port's limits (module docstring). Built per worker by
    `edge_protocol(limits)`; uvicorn makes one per connection.

    On a request's path it adds to uvicorn's a few comparisons in `data_received`, a test
    and a backwards look for `content-length` in `on_headers_complete` and a count in `on_body`;
    `on_body`, `on_message_complete` and `on_response_complete` replace uvicorn's (the same steps, without
    an extra call), the keep-alive timeout on the connection's own timer. No timer is armed or
    cancelled per request."""

    hot_handler: HotHandler | None = None  # class-wide, set by edge_protocol (a staticmethod there)
    on_refused: Callable[[], None] | None = None  # likewise: counts the port's own refusals
    # uvicorn's cycle, or a hot route's (`fleet/hot.py`), which quacks as one
    cycle: RequestResponseCycle | HotCycle  # type: ignore[assignment]
    limits: ClassVar[EdgeLimits]
    head_timeout_s: ClassVar[float]
    body_timeout_s: ClassVar[float]
    max_body: ClassVar[int]
    max_body_digits: ClassVar[int]  # a Content-Length with fewer digits is within max_body
    max_connections: ClassVar[int]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._phase = _OPEN
        self._deadline = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._measure = False  # the head being parsed may be over MAX_HEAD_BYTES: measure it when it ends
        self._head_bytes = 0  # bytes of a head's reads after the one it began in
        self._body_bytes = 0
        self._after = b""  # a refusal to write once the responses before it end (_refuse)

    # -- the connection's one timer ------------------------------------------------------------

    def _arm(self, deadline: float) -> None:
        """Make `deadline` the connection's; the timer moves only if it would fire too late."""
        self._deadline = deadline
        if self._timer is None or self._timer_at > deadline:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self.loop.call_at(deadline, self._on_timer)
            self._timer_at = deadline

    def _on_timer(self) -> None:
        self._timer = None
        deadline = self._deadline
        if not deadline:
            return  # armed again when a phase with a deadline starts
        if self.loop.time() < deadline - 0.001:  # the deadline moved on since: follow it
            self._timer = self.loop.call_at(deadline, self._on_timer)
            self._timer_at = deadline
            return
        self._deadline = 0.0
        phase = self._phase
        if phase == _HEAD:
            self._refuse(408, f"the request head did not arrive within {self.head_timeout_s:g} s")
        elif phase == _BODY:
            cycle = self.cycle
            if cycle.more_body and cycle.response_complete:
                self._linger()  # answered before its body was read, and the rest is late: no second answer
            elif cycle.more_body:
                self._refuse(408, f"the request body did not arrive within {self.body_timeout_s:g} s")
            # else the body is in and the response runs: no deadline of ours (this one was stale)
        else:  # a connection that never sent a byte, an idle keep-alive one, a lingering one
            self.transport.close()

    # -- connection ----------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.loop.time() + self.head_timeout_s)
        if len(self.connections) > self.max_connections:
            log.debug(
                "connection refused: %d open connections, the limit is %d",
                len(self.connections) - 1,
                self.max_connections,
            )
            self.transport.write(
                self._error(503, "too many open connections to this server; retry shortly", b"retry-after: 1\r\n")
            )
            self._linger()

    def connection_lost(self, exc: Exception | None) -> None:
        self._phase, self._deadline = _LINGER, 0.0
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        phase = self._phase
        if phase > _BODY:
            if phase == _LINGER:
                return  # refused: what the client still sends is dropped
            self._phase = _HEAD  # this read begins a request
        elif phase == _BODY and not self.cycle.more_body:
            self._phase = _HEAD  # a request sent before the previous one's answer ended
        if len(data) > MAX_HEAD_BYTES:
            self._measure = True  # a head in this read may be as large
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as upgrade:
            self._upgraded(data, upgrade)
        except httptools.HttpParserError as err:
            self._parse_failed(err, data)
        else:
            # Deadlines are set after the read, on the same loop time: a request that comes
            # whole in one read (the common case) sets none.
            now = self._phase
            if self._measure and now != _HEAD:
                self._measure = False  # every head of this read measured; none left half-read
            if now == _BODY:
                if phase != _BODY and self.cycle.more_body and not self.pipeline:
                    self._arm(self.loop.time() + self.body_timeout_s)  # its head ended in this read, its body did not
            elif now == _HEAD:
                if phase == _HEAD:  # a head begun in an earlier read: all of this read is head, so a
                    # count past the limit is a head past it (one whose last line never ends, too)
                    self._head_bytes += len(data)
                    if self._head_bytes > MAX_HEAD_BYTES:
                        self._refuse(431, f"the request head is larger than {MAX_HEAD_BYTES} bytes")
                else:  # begun in this read; the first request's deadline counts from the opening
                    self._head_bytes, self._measure = 0, True  # a head over several reads: measured at its end
                    if phase != _OPEN:
                        self._arm(self.loop.time() + self.head_timeout_s)

    def _upgraded(self, data: bytes, upgrade: httptools.HttpParserUpgrade) -> None:
        """After the head of a request with `Connection: upgrade`: a WebSocket upgrade uvicorn
        serves; a request with a body refused (httptools stops at the head of an upgrade, the
        body would never be read); else the upgrade ignored (RFC 9110 7.8, as uvicorn does:
        curl's `--http2` asks for h2c) and the bytes after it parsed."""
        if self._should_upgrade():
            self._phase, self._deadline = _LINGER, 0.0  # the WebSocket protocol takes over
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self.handle_websocket_upgrade()
            return
        if any(
            name == b"transfer-encoding" or (name == b"content-length" and value != b"0")
            for name, value in self.headers
        ):
            if self.cycle is not None:
                self.cycle.more_body = (
                    True  # llhttp ended the message at the head; its body is unread: this request is the refused one
                )
            self._refuse(
                400,
                "invalid HTTP request: an upgrade is not served on this port; "
                "send the request without an Upgrade header",
            )
            return
        log.debug("upgrade to %r ignored", self._get_upgrade())
        offset = upgrade.args[0] if upgrade.args else len(data)
        if offset < len(data):
            self.data_received(data[offset:])

    def _parse_failed(self, err: httptools.HttpParserError, data: bytes) -> None:
        """Refuse what the parser could not read (`data`: the read it failed in), naming why."""
        cause = err.__context__
        if isinstance(cause, _Refusal):
            self._refuse(cause.status, cause.message)
            return
        reason = str(err)[:120]
        if isinstance(err, httptools.HttpParserCallbackError):
            log.debug("request refused: %r", cause)
            message = self._callback_failure(cause)
        elif reason.startswith("Pause on PRI"):
            message = "invalid HTTP request: HTTP/2 with prior knowledge is not served on this port, HTTP/1.1 is"
        elif reason.startswith("Invalid method") and _is_tls_record(data):
            # an https:// URL aimed at this port: llhttp's reason ("Invalid method") would not say so
            message = "invalid HTTP request: TLS is not served on this port; use http://, not https://"
        else:
            message = f"invalid HTTP request: {reason}"
        self._refuse(400, message)

    def _head_size(self) -> int:
        """The parsed head's size in bytes: its request target, and each header line's name and
        value with 4 for the `: ` and CRLF around them."""
        return len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)

    def _callback_failure(self, cause: BaseException | None) -> str:
        """The 400's message for an error raised in uvicorn's parser callbacks: its cause named,
        never the input (a URL can carry what the client would not want logged)."""
        if isinstance(cause, httptools.HttpParserInvalidURLError):
            if self.parser.get_method() == b"CONNECT":
                return "invalid HTTP request: CONNECT is not served on this port (it is not a proxy)"
            return "invalid HTTP request: the request target is not a valid URL"
        if isinstance(cause, UnicodeError):
            return "invalid HTTP request: the request target is not ASCII"
        return "invalid HTTP request: the request head could not be read"

    # -- parser callbacks ----------------------------------------------------------------------

    def on_headers_complete(self) -> None:
        # only a head that may be over the limit is measured: one that came over several reads or
        # in a read larger than the limit (the common head, in one read of a few KiB, costs a test)
        if self._measure and self._head_size() > MAX_HEAD_BYTES:  # cleared after the read (data_received)
            raise _Refusal(431, f"the request head is larger than {MAX_HEAD_BYTES} bytes")
        # clients put content-length near the end (httpx, curl, aiohttp append it): look
        # backwards; httptools has refused a second one and anything but digits
        for name, value in reversed(self.headers):
            if name == b"content-length":
                if len(value) >= self.max_body_digits and int(value) > self.max_body:
                    raise _Refusal(413, f"request body is larger than {self.max_body} bytes")
                break
        chat = HOT_TARGETS.get(self.url) if self.hot_handler is not None else None
        if chat is None or self.parser.get_method() != b"POST" or self.parser.should_upgrade():
            _base_headers_complete(self)
        else:
            self._hot_headers_complete(chat)
        self._phase = _BODY
        self._body_bytes = 0
        if self.pipeline:
            self._deadline = 0.0  # queued behind a response, unread till then: its deadline starts with it

    def _hot_headers_complete(self, chat: bool) -> None:
        """uvicorn's `on_headers_complete` for a hot route: a `HotCycle`, begun now or queued
        behind the answer in progress (pipelining, as uvicorn queues its cycles)."""
        keep_alive = self.parser.get_http_version() != "1.0" and self.parser.should_keep_alive()
        existing = self.cycle
        cycle = HotCycle(self, chat, keep_alive, self.expect_100_continue)
        self.cycle = cycle
        if existing is None or existing.response_complete:
            cycle.begin()
        else:
            self.flow.pause_reading()
            self.pipeline.appendleft((cycle, self.app))  # type: ignore[arg-type]  # started by _start_asgi_task

    def _start_asgi_task(self, cycle: RequestResponseCycle | HotCycle, app: Any) -> None:
        if isinstance(cycle, HotCycle):  # a queued hot request's turn (uvicorn's on_response_complete)
            cycle.begin()
        else:
            super()._start_asgi_task(cycle, app)

    def resume_writing(self) -> None:
        """uvicorn's, and a relayed stream paused on this client's full socket goes on."""
        self.flow.resume_writing()
        cycle = self.cycle
        if isinstance(cycle, HotCycle) and cycle.on_writable is not None:
            cycle.on_writable()

    def on_body(self, body: bytes) -> None:
        """uvicorn's `on_body` with the body counted (its upgrade test left out: httptools stops
        at the head of an upgrade request, and one with a body is refused); a hot request's body
        is kept whole (it is bounded by `max_body`, and its task starts once it is in)."""
        self._body_bytes += len(body)
        if self._body_bytes > self.max_body:  # a chunked body: a declared length was checked
            raise _Refusal(413, f"request body is larger than {self.max_body} bytes")
        cycle = self.cycle
        if cycle.response_complete:
            return
        if isinstance(cycle, HotCycle):
            cycle.feed(body)
            return
        cycle.body += body
        if len(cycle.body) > HIGH_WATER_LIMIT:
            self.flow.pause_reading()
        cycle.message_event.set()

    def on_message_complete(self) -> None:
        """uvicorn's, and the end of a body whose request was answered before it was read (the
        rest was dropped, as uvicorn does): the connection idles then."""
        cycle = self.cycle
        if cycle is None or cycle.scope is not self.scope:
            return  # a WebSocket upgrade: no request cycle (uvicorn's upgrade test)
        if cycle.response_complete:
            if self._phase == _BODY and not self.pipeline:
                self._idle()
            return
        if isinstance(cycle, HotCycle):
            cycle.body_complete()
            return
        cycle.more_body = False
        cycle.message_event.set()

    def on_response_complete(self) -> None:
        if self.pipeline:  # uvicorn starts the queued request; its body deadline starts now
            _base_response_complete(self)
            if not self.pipeline and self._phase == _BODY and self.cycle.more_body:
                self._arm(self.loop.time() + self.body_timeout_s)
            return
        # uvicorn's own, but the keep-alive timeout goes on this connection's timer
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self.flow.resume_reading()
        phase = self._phase
        if phase == _BODY and not self.cycle.more_body:  # _idle(), inline: this is every request's path
            self._phase = _IDLE
            deadline = self.loop.time() + self.timeout_keep_alive
            if self._timer is None or self._timer_at > deadline:
                self._arm(deadline)
            else:  # the timer fires earlier and follows the deadline then: no timer operation
                self._deadline = deadline
        elif phase == _LINGER:  # refused while this response ran (_refuse): its refusal now, then the close
            if self._after:
                self.transport.write(self._after)
                self._after = b""
                self._linger()
            else:
                self.transport.close()
        # _BODY with more to come: answered before its body was read, which is dropped as it
        # arrives, under the body deadline (on_message_complete: then idle); _HEAD: the next
        # request's head is arriving, under its own deadline

    def _idle(self) -> None:
        """A keep-alive connection between requests: closed after `timeout_keep_alive`."""
        self._phase = _IDLE
        deadline = self.loop.time() + self.timeout_keep_alive
        if self._timer is None or self._timer_at > deadline:
            self._arm(deadline)
        else:  # the timer fires earlier and follows the deadline then: no timer operation
            self._deadline = deadline

    # -- refusals ------------------------------------------------------------------------------

    def _error(self, status: int, message: str, extra: bytes = b"") -> bytes:
        """A complete `Connection: close` response with the OpenAI error body (Anthropic's
        envelope for a request to the Anthropic adapter's routes, as their other errors)."""
        path = getattr(self, "url", b"").partition(b"?")[0]
        body = error_envelope(status, message) if path in ANTHROPIC_TARGETS else error_body(status, message)
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head.append(
            b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n%s\r\n" % (len(body), extra)
        )
        return b"".join(head) + body

    def _refuse(self, status: int, message: str) -> None:
        """Answer `status` and close. Requests parsed whole before the refused bytes (pipelined in
        the same write, or queued behind a slow response) are answered first, in order, and the
        refusal after them (`_after`, written by `on_response_complete`). A refused request whose
        own answer is on the wire already is not answered twice: its connection closes after it."""
        log.debug("request refused with %d: %s", status, message)
        if self.on_refused is not None:
            self.on_refused()
        # the request parsed last (None before the first): the refused one while its body is unread
        cycle: RequestResponseCycle | HotCycle | None = self.cycle
        self._phase, self._deadline = _LINGER, 0.0  # what the client sends from now on is dropped
        if cycle is not None and cycle.more_body:  # the refusal is this request's (its body)
            if self.pipeline and self.pipeline[0][0] is cycle:
                self.pipeline.popleft()  # queued, never started: the requests before it run on
            elif cycle.response_started:
                if not cycle.response_complete:
                    cycle.keep_alive = False  # answered while its body came: the answer ends, then the close
                else:
                    self._linger()
                return
            else:
                cycle.disconnected = True  # the app's receive() returns http.disconnect; its sends are dropped
                cycle.message_event.set()
                cycle = None
        if self.pipeline or (cycle is not None and not cycle.response_complete):
            self._after = self._error(status, message)  # after the answers to the requests before it
            return
        self.transport.write(self._error(status, message))
        self._linger()

    def _linger(self) -> None:
        """Shut the write side, drop what the client still sends, close at its EOF (uvicorn's
        `eof_received`) or after LINGER_S."""
        self._phase = _LINGER
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.flow.resume_reading()
        self._arm(self.loop.time() + LINGER_S)
