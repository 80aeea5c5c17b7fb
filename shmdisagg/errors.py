"""OpenAI-style error bodies and the exceptions request flows raise.

Every error a client sees goes through `error_body`, so the shape is the same everywhere:
`{"object": "error", "message", "type", "param", "code"}` (TensorRT-LLM's `ErrorResponse`,
which follows the OpenAI API's error object).
"""

from __future__ import annotations

import orjson

_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    408: "RequestTimeoutError",
    413: "RequestEntityTooLarge",
    429: "RateLimitError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


class RequestError(Exception):
    """A request that ends with an HTTP error for the client (status, message, stable code)."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param

    def body(self) -> bytes:
        return error_body(self.status, self.message, self.code, self.param)


def error_body(status: int, message: str, code: str, param: str | None = None) -> bytes:
    """JSON bytes of an OpenAI error object for `status`."""
    return orjson.dumps(
        {
            "object": "error",
            "message": message,
            "type": _TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError"),
            "param": param,
            "code": code,
        }
    )


def sse_error_event(status: int, message: str, code: str) -> bytes:
    """The SSE error event sent after a stream has started, followed by `[DONE]`.

    Same shape as TensorRT-LLM's worker: `data: {"error": {...}}` then `data: [DONE]`.
    """
    err = orjson.loads(error_body(status, message, code))
    return b"data: " + orjson.dumps({"error": err}) + b"\n\ndata: [DONE]\n\n"
