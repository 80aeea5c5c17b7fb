"""What a fleet worker observes of each request for TensorRT-LLM's observability settings:
`return_perf_metrics` (per-request metrics to the client), `perf_metrics_output_dir` (a JSONL
line per request), `otlp_config` (OpenTelemetry spans, `tracing.py`) and
`TRTLLM_REQUEST_TRACE_DIR` (request/response trace shards, `request_trace.py`).

`Observability.wrap(handle)` wraps `DisaggService.handle` like upstream's ASGI middlewares
(`PerfMetricsMiddleware` and the handler decorators of `openai_disagg_server.py`, id
70144234291): it puts a `RequestObservation` in a context variable for the request's task (and
the leg tasks it starts), and wraps the ASGI `send`. Legs go through `send_leg` (legs.py), which
adds the request headers an observed request needs and returns the executor's response wrapped
(`ObservedLeg`). With none of the four settings, `wrap` returns `handle` itself and `send_leg`
costs one context-variable read per leg.

Per-request metrics (upstream: `perf_metrics.py` id 56757725682, `openai_client.py` @00cc02a3):
- A request is measured when `perf_metrics_output_dir` is set, or when `return_perf_metrics`
  is and the client sent `X-TRTLLM-return-metrics: 1`. Only then are its legs sent with
  `X-TRTLLM-return-metrics: 1` (upstream asks on every request once either key is set; the
  answer is the same, the cost lands only on requests that use it).
- The executors answer with metric headers (non-streaming) or a trailing `event:
  trtllm.perf_metrics` SSE event after `data: [DONE]` (streams); `ObservedLeg` reads them and
  removes the event from the bytes relayed to the client.
- The request's record (`perf_record.combine`) joins the orchestrator's timing (arrival, context
  dispatch, first token, last token, on CLOCK_MONOTONIC) with both executors' phases. It exists
  only for a complete 200 answer (upstream builds it in `on_resp_done`).
- When the client asked and `return_perf_metrics` is set, a non-streaming answer carries
  `Server-Timing`, `X-TRTLLM-Start-End-Time` (and `X-TRTLLM-Step-Metrics`,
  `X-TRTLLM-Ctx-Chunk-Metrics` when an executor sent them); a stream ends with the
  `trtllm.perf_metrics` event after its `data: [DONE]`. Nothing is added otherwise.
- With `perf_metrics_output_dir`, the record goes to `metrics/jsonl.py`.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from shmdisagg.metrics import perf_record as pr
from shmdisagg.orchestrator.asgi import Message, Receive, Scope, Send

if TYPE_CHECKING:
    from shmdisagg.metrics.jsonl import PerfMetricsJsonlWriter
    from shmdisagg.request_trace import RequestTrace, RequestTraceWriter
    from shmdisagg.tracing import Tracing
    from shmdisagg.upstream import Body, UpstreamPool, UpstreamResponse

Handler = Callable[[Scope, Receive, Send, bool], Awaitable[None]]

RETURN_METRICS = pr.RETURN_METRICS_HEADER.lower().encode()
ASK_METRICS = [(RETURN_METRICS, b"1")]
_NO_HEADERS: list[tuple[bytes, bytes]] = []


class Observability:
    """One worker's settings and outputs. `enabled`: any of the four is on."""

    def __init__(
        self,
        expose: bool = False,
        writer: PerfMetricsJsonlWriter | None = None,
        tracing: Tracing | None = None,
        trace_writer: RequestTraceWriter | None = None,
    ) -> None:
        self.expose = expose  # return_perf_metrics
        self.writer = writer
        self.tracing = tracing
        self.trace_writer = trace_writer

    @classmethod
    def from_config(cls, config: Any, environ: dict[str, str] | None = None) -> Observability:
        """The worker's observability from its config (and `TRTLLM_REQUEST_TRACE_DIR`). Nothing
        is started (`start`); OpenTelemetry is imported only with `otlp_config`."""
        from shmdisagg.request_trace import trace_dir_from_env

        writer = trace_writer = tracing = None
        if config.perf_metrics_output_dir:
            from shmdisagg.metrics.jsonl import PerfMetricsJsonlWriter

            writer = PerfMetricsJsonlWriter(config.perf_metrics_output_dir, "disagg")
        otlp = config.otlp_config
        if otlp is not None and otlp.otlp_traces_endpoint:
            from shmdisagg.tracing import Tracing

            tracing = Tracing.for_endpoint(otlp.otlp_traces_endpoint)
        trace_dir = trace_dir_from_env(environ)
        if trace_dir:
            from shmdisagg.request_trace import RequestTraceWriter

            trace_writer = RequestTraceWriter(trace_dir)
        return cls(config.return_perf_metrics, writer, tracing, trace_writer)

    @property
    def enabled(self) -> bool:
        return bool(self.expose or self.writer or self.tracing or self.trace_writer)

    def start(self) -> None:
        """Open the output files. Raises OSError."""
        if self.writer is not None:
            self.writer.start()
        if self.trace_writer is not None:
            self.trace_writer.start()

    def close(self) -> None:
        """Flush and close every output (the JSONL files, the trace shards, the span exporter)."""
        if self.writer is not None:
            self.writer.close()
        if self.trace_writer is not None:
            self.trace_writer.close()
        if self.tracing is not None:
            self.tracing.shutdown()

    def wrap(self, handle: Handler) -> Handler:
        """`handle` observed; `handle` itself when nothing is to be observed."""
        if not self.enabled:
            return handle

        async def observed(scope: Scope, receive: Receive, send: Send, chat: bool) -> None:
            asked = self.expose and _asked(scope)
            if not (asked or self.writer or self.tracing or self.trace_writer):
                await handle(scope, receive, send, chat)
                return
            obs = RequestObservation(self, asked, scope)
            token = CURRENT.set(obs)
            try:
                await handle(scope, obs.receive(receive) if obs.trace is not None else receive, obs.sender(send), chat)
            finally:
                CURRENT.reset(token)
                obs.close()

        return observed


def _asked(scope: Scope) -> bool:
    headers: Iterable[tuple[bytes, bytes]] = scope.get("headers", ())  # ASGI: (name, value) byte pairs
    for name, value in headers:
        if name == RETURN_METRICS:
            return value.strip() == b"1"
    return False


class RequestObservation:
    """One request as observed: its legs' state and metrics, what the client was sent, its span
    and trace. Times are CLOCK_MONOTONIC seconds (0.0: did not happen)."""

    __slots__ = (
        "o", "asked", "measured", "arrival", "ctx_dispatch", "ctx_done", "first_token", "ctx_server", "gen_server",
        "ctx_metrics", "gen_metrics", "gen_state", "from_context", "status", "stream", "rid", "ended", "record",
        "span", "span_token", "trace", "leg_headers",
    )  # fmt: skip

    def __init__(self, o: Observability, asked: bool, scope: Scope) -> None:
        self.o = o
        self.asked = asked  # the client wants the metrics back
        self.measured = asked or o.writer is not None
        self.leg_headers = ASK_METRICS if self.measured else _NO_HEADERS
        self.arrival = time.monotonic()
        self.ctx_dispatch = self.ctx_done = self.first_token = 0.0
        self.ctx_server = self.gen_server = ""
        self.ctx_metrics: dict[str, Any] | None = None
        self.gen_metrics: dict[str, Any] | None = None
        self.gen_state = ""  # "" no generation leg, "open", "complete", "failed"
        self.from_context = False  # the client's answer was built from the context leg
        self.status = 0
        self.stream = False
        self.rid: int | None = None
        self.ended = False  # the client was sent its last body message
        self.record: dict[str, Any] | None = None
        self.span = self.span_token = None
        if o.tracing is not None:
            self.span, self.span_token = o.tracing.start_request(list(scope.get("headers", ())))
        self.trace: RequestTrace | None = None
        if o.trace_writer is not None:
            from shmdisagg.request_trace import RequestTrace

            self.trace = RequestTrace(o.trace_writer, scope, self.arrival)

    # -- legs ---------------------------------------------------------------------------------

    async def send_leg(
        self,
        upstream: UpstreamPool,
        role: str,
        host: str,
        port: int,
        path: str,
        body: Body,
        headers: Sequence[tuple[bytes, bytes]] = (),
        timeout_s: float | None = None,
        whole: bool = False,
        total: bool = False,
    ) -> Any:
        now = time.monotonic()
        if role == "context" and not self.ctx_dispatch:
            self.ctx_dispatch = now
        if self.trace is not None:
            self.trace.accepted()
        tracing = self.o.tracing
        span = tracing.start_leg(role, host, port) if tracing is not None else None
        try:
            resp = await upstream.request(
                host,
                port,
                "POST",
                path,
                body,
                headers=[*headers, *self.leg_headers],
                timeout_s=timeout_s,
                whole=whole,
                total=total,
            )
        except BaseException as err:
            if span is not None:
                tracing.end_leg(span, f"{type(err).__name__}: {err}")  # type: ignore[union-attr]  # a span implies tracing
            raise
        return ObservedLeg(self, role, f"{host}:{port}", resp, span)

    # -- the client side ----------------------------------------------------------------------

    def receive(self, receive: Receive) -> Receive:
        trace = self.trace
        assert trace is not None

        async def tee() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                trace.body.append(message.get("body", b""))
            return message

        return tee

    def sender(self, send: Send) -> Send:
        async def observed_send(message: Message) -> None:
            kind = message["type"]
            if kind == "http.response.start":
                message = self._on_start(message)
            elif kind == "http.response.body":
                if self.trace is not None:
                    self.trace.response.append(message.get("body", b""))
                if not message.get("more_body", False):
                    message = self._on_end(message)
            await send(message)

        return observed_send

    def _on_start(self, message: Message) -> Message:
        self.status = message["status"]
        headers = message.get("headers") or []
        for name, value in headers:
            if name == b"content-type":
                self.stream = value.lower().startswith(b"text/event-stream")
            elif name == b"x-disagg-request-id":
                try:
                    self.rid = int(value)
                except ValueError:
                    pass
        # No live generation leg when the answer starts: it was built from the context leg.
        self.from_context = self.gen_state not in ("open", "complete")
        if self.measured and self.status == 200 and not self.stream and self._complete():
            self.record = self._build_record()
            if self.asked:
                message = {**message, "headers": [*headers, *pr.header_pairs(pr.metrics_headers([self.record]))]}
        return message

    def _on_end(self, message: Message) -> Message:
        self.ended = True
        if self.measured and self.status == 200:
            if self.stream and self._complete():
                self.record = self._build_record()
                if self.asked:
                    message = {
                        **message,
                        "body": message.get("body", b"") + pr.sse_event(pr.metrics_headers([self.record])),
                    }
            if self.record is not None and self.o.writer is not None:
                self.o.writer.submit(self.record)
        return message

    def _complete(self) -> bool:
        """The client's answer is whole: the generation leg finished, or the answer came from a
        context leg that did."""
        return self.gen_state == "complete" or (self.from_context and self.ctx_done > 0)

    def _build_record(self) -> dict[str, Any]:
        now = time.monotonic()
        rid = self.rid
        first = self.first_token if self.gen_state == "complete" else self.ctx_done
        timing = {
            "arrival_time": self.arrival,
            "last_token_time": now,
            "server_arrival_time": self.arrival,
            "ctx_dispatch_time": self.ctx_dispatch or None,
            "server_first_token_time": first or None,
        }
        gen_done = self.gen_state == "complete"
        disagg = {
            "ctx_server": self.ctx_server,
            "gen_server": self.gen_server if gen_done else "",
            "timing_metrics": timing,
        }
        request_id = str(rid) if rid is not None else ""
        ctx, gen = self.ctx_metrics, self.gen_metrics if gen_done else None
        for phase in (ctx, gen):
            if phase is not None:
                phase["request_id"] = request_id
        return pr.combine(request_id, disagg, ctx, gen, rid)

    def close(self) -> None:
        """At the end of the handler: close the span and the trace."""
        complete = self.ended and self.status == 200 and self._complete()
        if complete:
            error = None
        elif not self.ended:
            error = "client disconnected"
        elif self.status != 200:
            error = f"HTTP {self.status}"
        else:
            error = "stream ended early"
        if self.span is not None:
            self.o.tracing.end_request(self.span, self.span_token, self.status, self.rid, error)  # type: ignore[union-attr]  # a span implies tracing
        trace = self.trace
        if trace is not None and not trace.done:
            if not trace.request_written and self.status >= 400:
                trace.rejected(self.status, b"".join(trace.response))
            elif complete:
                trace.finish("completed", 200, self.stream, self.rid)
            elif not self.ended:
                trace.finish("client_disconnected", self.status or 499, self.stream, self.rid)
            elif self.status != 200:
                trace.finish(
                    f"rejected_{self.status}" if self.status < 500 else "error", self.status, self.stream, self.rid
                )
            else:
                trace.finish(
                    "error",
                    200,
                    self.stream,
                    self.rid,
                    {"cause": "stream_error", "detail": "the stream ended with an error event"},
                )


class ObservedLeg:
    """An executor's response as the flows use it (`UpstreamResponse`'s interface), noting the
    leg's state in its `RequestObservation`, reading its metrics, and dropping the executor's
    trailing `trtllm.perf_metrics` event from the bytes a stream yields."""

    __slots__ = ("obs", "role", "addr", "resp", "span", "status", "headers", "_filter", "_done", "_seen")

    def __init__(self, obs: RequestObservation, role: str, addr: str, resp: UpstreamResponse, span: Any) -> None:
        self.obs = obs
        self.role = role
        self.addr = addr
        self.resp = resp
        self.span = span
        self.status = resp.status
        self.headers = resp.headers
        self._done = False
        self._seen = False
        self._filter = MetricsEventFilter() if obs.measured and resp.is_event_stream else None
        if span is not None:
            obs.o.tracing.leg_status(span, resp.status)  # type: ignore[union-attr]  # a span implies tracing
        if role == "generation" and resp.status == 200:
            obs.gen_state = "open"
        if obs.measured and resp.status == 200 and not resp.is_event_stream:
            self._metrics(pr.metric_headers_from_pairs(resp.headers))

    def __getattr__(self, name: str) -> Any:  # anything else of UpstreamResponse
        return getattr(self.resp, name)

    def header(self, name: bytes) -> bytes | None:
        return self.resp.header(name)

    @property
    def is_event_stream(self) -> bool:
        return self.resp.is_event_stream

    def _metrics(self, headers: dict[str, Any]) -> None:
        if self.role == "context":
            self.obs.ctx_metrics = pr.record_from_headers(headers, "ctx")
        else:
            self.obs.gen_metrics = pr.record_from_headers(headers, "gen")

    def _finished(self) -> None:
        self._done = True
        obs = self.obs
        if self.status == 200:
            if self.role == "context":
                obs.ctx_done = time.monotonic()
                obs.ctx_server = self.addr
            else:
                if not obs.first_token:
                    obs.first_token = time.monotonic()
                obs.gen_state = "complete"
                obs.gen_server = self.addr
        if self.span is not None:
            obs.o.tracing.end_leg(self.span)  # type: ignore[union-attr]  # a span implies tracing

    def _failed(self, err: BaseException | str) -> None:
        if self._done:
            return
        self._done = True
        if self.role == "generation" and self.obs.gen_state == "open":
            self.obs.gen_state = "failed"
        if self.span is not None:
            self.obs.o.tracing.end_leg(self.span, err if isinstance(err, str) else f"{type(err).__name__}: {err}")  # type: ignore[union-attr]  # a span implies tracing

    def body(self) -> bytes:
        try:
            body = self.resp.body()
        except BaseException as err:
            self._failed(err)
            raise
        if not self._done:
            self._finished()
        return body

    async def read(self) -> bytes:
        try:
            body = await self.resp.read()
        except BaseException as err:
            self._failed(err)
            raise
        if not self._done:
            self._finished()
        return body

    def __aiter__(self) -> ObservedLeg:
        return self

    async def __anext__(self) -> bytes:
        while True:
            try:
                chunk = await self.resp.__anext__()
            except StopAsyncIteration:
                if self._filter is not None:
                    tail, event = self._filter.finish()
                    if event:
                        parsed = pr.parse_sse_event(event)
                        if parsed is not None and self.status == 200:
                            self._metrics(parsed)
                    if tail:
                        return tail
                if not self._done:
                    self._finished()
                raise
            except BaseException as err:
                self._failed(err)
                raise
            if chunk and not self._seen and self.role == "generation":
                self._seen = True
                self.obs.first_token = time.monotonic()
            if self._filter is not None:
                chunk = self._filter.feed(chunk)
            if chunk:
                return chunk

    def abort(self) -> None:
        self.resp.abort()
        self._failed("aborted")


class MetricsEventFilter:
    """Splits an executor's SSE bytes into what the client gets and the trailing
    `trtllm.perf_metrics` event (upstream: `OpenAIHttpClient._response_generator`). Whole events
    pass at once; only an event split across reads waits for its end."""

    __slots__ = ("pending", "event")

    def __init__(self) -> None:
        self.pending = b""
        self.event = b""

    def feed(self, chunk: bytes) -> bytes:
        if self.event:
            self.event += chunk
            return b""
        data = self.pending + chunk if self.pending else chunk
        at = data.find(pr.SSE_METRICS_MARKER)
        if at >= 0:
            self.event = data[at:]
            self.pending = b""
            return data[:at]
        end = data.rfind(b"\n\n")
        if end < 0:
            self.pending = data
            return b""
        cut = end + 2
        self.pending = data[cut:]
        return data[:cut]

    def finish(self) -> tuple[bytes, bytes]:
        """(bytes still to relay, the metrics event or b"") at the end of the stream."""
        tail, self.pending = self.pending, b""
        return tail, self.event


CURRENT: ContextVar[RequestObservation | None] = ContextVar("shmdisagg_observation", default=None)


def send_leg(
    upstream: UpstreamPool,
    role: str,
    host: str,
    port: int,
    path: str,
    body: Body,
    headers: Sequence[tuple[bytes, bytes]] = (),
    timeout_s: float | None = None,
    whole: bool = False,
    total: bool = False,
) -> Awaitable[UpstreamResponse]:
    """POST one leg with `headers` (await the result): `upstream.request`'s own coroutine for a
    request nobody observes (a plain call, so no coroutine frame is added to the hot path), else
    the observation's, which adds its leg headers and wraps the response (`ObservedLeg`, same
    interface)."""
    obs = CURRENT.get()
    if obs is None:
        return upstream.request(
            host, port, "POST", path, body, headers=headers, timeout_s=timeout_s, whole=whole, total=total
        )
    return obs.send_leg(upstream, role, host, port, path, body, headers, timeout_s, whole, total)
