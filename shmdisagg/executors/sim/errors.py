"""Exceptions of the simulator and the bodies trtllm-serve answers them with.

Three shapes, as TensorRT-LLM's `serve/openai_server.py` (worker copy @fb31828e) answers:

- `ValidationFailed` (the request does not fit the protocol models: unknown field, wrong type,
  a model validator): status 400, body `{"error": "<message>"}`, FastAPI's
  `RequestValidationError` handler (`UnreadableBody`, a msgpack body that does not decode:
  FastAPI's 400 `{"detail": ...}`).
- `RequestError` / `SimError` (a ValueError while handling the request): `ErrorResponse`
  `{"object": "error", "message", "type", "param", "code": <int status>}` (`error_body`).
- an error after an SSE stream started: `data: {"error": {"message", "type": "server_error",
  "code": null, "param": null}}` then `data: [DONE]` (`sse_error`, the completion generator's).
"""

from __future__ import annotations

import argparse
import json
from typing import Any, NoReturn

_STATUS_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    409: "ConflictError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


class ConfigError(ValueError):
    """A bad option, profile or extra_llm_api_options file; the CLI exits with status 2."""


class RaisingArgumentParser(argparse.ArgumentParser):
    """argparse that raises ConfigError instead of printing usage and exiting."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


class SimError(Exception):
    """A request that fails with an HTTP status and an `ErrorResponse` body."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = status if code is None else code


class RequestError(SimError):
    """The request is refused while being handled (status 400), TensorRT-LLM's ValueError path."""


class ValidationFailed(RequestError):
    """The body does not validate against the protocol models (status 400, `{"error": ...}`)."""


class UnreadableBody(RequestError):
    """A msgpack body that does not decode: FastAPI's 400 `{"detail": "There was an error parsing the body"}`."""


class TransferError(SimError):
    """The KV pull from the context executor failed (status 500 to the generation client)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, status=500)


def error_body(exc: SimError) -> dict[str, Any]:
    """TensorRT-LLM's `ErrorResponse`: {object, message, type, param, code}; a `ValidationFailed`
    gets FastAPI's `{"error": message}` instead."""
    if isinstance(exc, ValidationFailed):
        return {"error": exc.message}
    if isinstance(exc, UnreadableBody):
        return {"detail": exc.message}
    return {
        "object": "error",
        "message": exc.message,
        "type": _STATUS_TYPES.get(exc.status, "InternalServerError"),
        "param": exc.param,
        "code": exc.code,
    }


def sse_error(exc: SimError) -> bytes:
    """The last bytes of a stream that failed after it started, as the completion generator of
    `openai_server.py` writes them (`type` "server_error", `code` and `param` null)."""
    event = {"error": {"message": exc.message, "type": "server_error", "code": None, "param": None}}
    return f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode()  # json.dumps: upstream's bytes
