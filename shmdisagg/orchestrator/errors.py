"""Error bodies and the exception request flows raise.

Every error a client sees goes through `error_body` or `sse_error_event`, so the shape is the
same everywhere, before and after a stream started: TensorRT-LLM's `ErrorResponse`
(`tensorrt_llm/serve/openai_protocol.py`: `object`, `message`, `type`, `param`, and `code`, an
int, the HTTP status, as `OpenAIServer.create_error_response` fills it in
`tensorrt_llm/serve/openai_server.py`). A started stream ends with that object under `"error"`
(the wrapper upstream's worker uses for its SSE error event) and `data: [DONE]`.

`RequestError.code` is a stable machine-readable reason (`no_generation_servers`,
`shutting_down`, ...): it goes to the metrics and the logs, not into the body, whose `code` is
always the status.
"""

from __future__ import annotations

import orjson

_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    408: "RequestTimeoutError",
    413: "RequestEntityTooLarge",
    415: "UnsupportedMediaTypeError",
    429: "RateLimitError",
    500: "InternalServerError",
    501: "NotImplementedError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


class RequestError(Exception):
    """A request that ends with an HTTP error for the client: `status`, `message` (what the
    client reads; never an executor address), `code` (the stable reason, for metrics and logs)
    and `param` (the request field at fault, if any)."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param

    def body(self) -> bytes:
        return error_body(self.status, self.message, self.param)


def error_object(status: int, message: str, param: str | None = None) -> dict[str, object]:
    """The `ErrorResponse` object for `status` (`type` named as TensorRT-LLM's worker names it)."""
    kind = _TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")
    return {"object": "error", "message": message, "type": kind, "param": param, "code": status}


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    """JSON bytes of the `ErrorResponse` for `status`."""
    return orjson.dumps(error_object(status, message, param))


def sse_error_event(status: int, message: str, param: str | None = None) -> bytes:
    """The SSE error event that ends a started stream, followed by `data: [DONE]`:
    `data: {"error": <ErrorResponse>}` (the wrapper of TensorRT-LLM's worker's SSE error event,
    `tensorrt_llm/serve/openai_server.py`, with the same object as a JSON error body)."""
    return b"data: " + orjson.dumps({"error": error_object(status, message, param)}) + b"\n\ndata: [DONE]\n\n"
