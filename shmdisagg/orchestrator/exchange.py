"""Per-request state shared by a flow, the error handling around it and the metrics sinks.

Timing fields are wall-clock seconds (`time.time()`), the unit TensorRT-LLM's perf records use
(`disagg_server_arrival_time`, ...); 0.0 means "did not happen".
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shmdisagg.orchestrator.asgi import JSON_HEADERS, Responder
from shmdisagg.orchestrator.errors import error_body, sse_error_event


@dataclass(slots=True)
class Exchange:
    """One client exchange: once `started`, errors must go in-band (an SSE error event).
    `out` is where the answer goes; `expired`: the request's deadline cancelled it."""

    out: Responder
    disagg_request_id: int
    stream: bool
    extra_headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    started: bool = False
    status: int = 0
    # the per-request record (perf metrics, Prometheus)
    chat: bool = False
    arrival: float = 0.0
    ctx_slot: int = -1
    gen_slot: int = -1
    ctx_dispatch: float = 0.0
    ctx_done: float = 0.0
    first_token: float = 0.0
    last_token: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    retries: int = 0
    error_code: str = ""
    expired: bool = False

    async def start(self, status: int, headers: list[tuple[bytes, bytes]], eager: bool = False) -> None:
        """Start the answer; its head may wait for the first body bytes unless `eager` (a stream)."""
        self.started = True
        self.status = status
        if status >= 400 and not self.error_code:
            self.error_code = f"http_{status}"
        rid = (b"x-disagg-request-id", str(self.disagg_request_id).encode())
        await self.out.start(status, [*headers, rid, *self.extra_headers])
        if eager:
            self.out.flush_head()

    async def body(self, chunk: bytes, more: bool) -> None:
        await self.out.body(chunk, more)

    async def fail(self, status: int, message: str, code: str) -> None:
        """End the response with an error: a JSON error before any byte, an SSE error event
        followed by `[DONE]` after (or just the end of a non-streaming body)."""
        self.error_code = code
        if not self.started:
            await self.start(status, JSON_HEADERS)
            await self.body(error_body(status, message), False)
        elif self.stream:
            await self.body(sse_error_event(status, message), False)
        else:
            await self.body(b"", False)
