"""`otlp_config.otlp_traces_endpoint`: OpenTelemetry spans of each request, exported over OTLP.

TensorRT-LLM's orchestrator (`tensorrt_llm/serve/openai_disagg_server.py`, id 70144234291, and
`tensorrt_llm/llmapi/tracing.py`): when `otlp_config.otlp_traces_endpoint` is set it builds a
`TracerProvider` with a `BatchSpanProcessor` around an OTLP span exporter for that endpoint
(`OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`: `grpc`, the default, or `http/protobuf`), takes the
tracer `trt.llm`, and wraps each completion handler in a span `disaggregated_request` of kind
SERVER whose parent is the client's W3C trace context (`traceparent` / `tracestate` request
headers); the span's status is OK, or ERROR with the exception recorded.

Here, in each fleet worker process:
- `disaggregated_request` (SERVER, parent from the client's `traceparent`) covers the whole
  exchange, a stream included (upstream's ends when its handler returns the stream). Status OK
  when the client got a complete 200 answer, else ERROR with the reason (`HTTP 503`, `stream
  ended early`, `client disconnected`). Attributes: `gen_ai.request.id` (the
  `disagg_request_id`, upstream's `SpanAttributes.GEN_AI_REQUEST_ID` name),
  `http.response.status_code`.
- one child span per leg attempt, `context` or `generation` (CLIENT), from the request to the
  end of its response body, with `server.address`, `server.port`, `http.response.status_code`
  (OpenTelemetry's HTTP client conventions; upstream has no leg spans). Upstream's client does
  not send trace context to its workers (`openai_client.py` @00cc02a3 sets no `traceparent`),
  so neither does shmdisagg.

Nothing of OpenTelemetry is imported unless `otlp_config` is set; a request then pays a
ContextVar read. Start-up refuses (`otlp_problem`) a config whose exporter cannot be built.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Any

log = logging.getLogger("shmdisagg.tracing")

INSTRUMENTING_MODULE = "trt.llm"  # upstream's tracer name
REQUEST_SPAN = "disaggregated_request"
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
_EXPORTERS = {
    "grpc": "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
    "http/protobuf": "opentelemetry.exporter.otlp.proto.http.trace_exporter",
}
INSTALL_HINT = "pip install 'shmdisagg[otlp]'"


def _protocol() -> str:
    return os.environ.get(PROTOCOL_ENV, "grpc")


def otlp_problem(environ: dict[str, str] | None = None) -> str | None:
    """Why `otlp_config` cannot be honoured on this machine (None: it can). Reads the protocol
    from `environ` (default `os.environ`) and checks the packages without importing them."""
    protocol = (environ if environ is not None else os.environ).get(PROTOCOL_ENV, "grpc")
    module = _EXPORTERS.get(protocol)
    if module is None:
        return f"{PROTOCOL_ENV}={protocol!r} is not one of {', '.join(_EXPORTERS)}"
    for needed in ("opentelemetry.sdk.trace", module):
        try:
            found = importlib.util.find_spec(needed) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            return (
                f"needs the OpenTelemetry SDK and its OTLP {protocol} exporter ({needed} is not installed): "
                f"{INSTALL_HINT}"
            )
    return None


class Tracing:
    """A tracer of one process. Build with `for_endpoint` (OTLP) or `for_exporter` (tests:
    e.g. an `InMemorySpanExporter`, exported synchronously)."""

    def __init__(self, provider: Any) -> None:
        from opentelemetry import context, trace
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self.tracer = provider.get_tracer(INSTRUMENTING_MODULE)
        self._context = context
        self._trace = trace
        self._server, self._client = SpanKind.SERVER, SpanKind.CLIENT
        self._ok, self._error, self._status = StatusCode.OK, StatusCode.ERROR, Status
        self._propagator = TraceContextTextMapPropagator()

    @classmethod
    def for_endpoint(cls, endpoint: str) -> Tracing:
        """Upstream's `init_tracer`: a batch processor around the OTLP exporter of
        `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`. Raises ValueError for another protocol."""
        protocol = _protocol()
        if protocol not in _EXPORTERS:
            raise ValueError(f"unsupported OTLP protocol {protocol!r}")
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        exporter = importlib.import_module(_EXPORTERS[protocol]).OTLPSpanExporter(endpoint=endpoint)
        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(exporter))
        return cls(provider)

    @classmethod
    def for_exporter(cls, exporter: Any) -> Tracing:
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor

        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        return cls(provider)

    # -- the request span ---------------------------------------------------------------------

    def start_request(self, headers: list[tuple[bytes, bytes]]) -> tuple[Any, Any]:
        """Open `disaggregated_request` under the client's trace context and make it current
        (legs started in this task, or in tasks it creates, become its children). Returns
        (span, token for `end_request`)."""
        carrier = {
            name.decode("latin-1"): value.decode("latin-1")
            for name, value in headers
            if name in (b"traceparent", b"tracestate")
        }
        parent = self._propagator.extract(carrier) if carrier else None
        span = self.tracer.start_span(REQUEST_SPAN, context=parent, kind=self._server)
        token = self._context.attach(self._trace.set_span_in_context(span))
        return span, token

    def end_request(self, span: Any, token: Any, status: int, request_id: int | None, error: str | None) -> None:
        """Close the request span: OK unless `error` (the reason it did not complete)."""
        try:
            if request_id:
                span.set_attribute("gen_ai.request.id", str(request_id))
            if status:
                span.set_attribute("http.response.status_code", status)
            span.set_status(self._status(self._ok) if error is None else self._status(self._error, error))
            span.end()
        finally:
            self._context.detach(token)

    # -- leg spans ----------------------------------------------------------------------------

    def start_leg(self, role: str, host: str, port: int) -> Any:
        span = self.tracer.start_span(role, kind=self._client)
        span.set_attribute("server.address", host)
        span.set_attribute("server.port", port)
        return span

    def leg_status(self, span: Any, status: int) -> None:
        span.set_attribute("http.response.status_code", status)
        if status >= 400:
            span.set_status(self._status(self._error, f"HTTP {status}"))

    def end_leg(self, span: Any, error: str | None = None) -> None:
        if error is not None:
            span.set_status(self._status(self._error, error))
        span.end()

    def shutdown(self) -> None:
        """Export what the batch processor holds, then stop it."""
        try:
            self.provider.shutdown()
        except Exception:  # an unreachable collector must not fail a shutdown
            log.exception("OpenTelemetry shutdown failed")
