"""Per-request response state shared by a flow and the error handling around it."""

from __future__ import annotations

from dataclasses import dataclass, field

from shmdisagg.asgi import JSON_HEADERS, Send
from shmdisagg.errors import error_body, sse_error_event


@dataclass(slots=True)
class Exchange:
    """One client exchange: once `started`, errors must go in-band (an SSE error event)."""

    send: Send
    disagg_request_id: int
    stream: bool
    extra_headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    started: bool = False
    status: int = 0

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.started = True
        self.status = status
        rid = (b"x-disagg-request-id", str(self.disagg_request_id).encode())
        await self.send({"type": "http.response.start", "status": status, "headers": headers + [rid] + self.extra_headers})

    async def body(self, chunk: bytes, more: bool) -> None:
        await self.send({"type": "http.response.body", "body": chunk, "more_body": more})

    async def fail(self, status: int, message: str, code: str) -> None:
        """End the response with an error: a JSON error before any byte, an SSE error event
        followed by `[DONE]` after (or just the end of a non-streaming body)."""
        if not self.started:
            await self.start(status, JSON_HEADERS)
            await self.body(error_body(status, message, code), False)
        elif self.stream:
            await self.body(sse_error_event(status, message, code), False)
        else:
            await self.body(b"", False)
