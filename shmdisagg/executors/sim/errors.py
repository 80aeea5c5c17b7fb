"""Exceptions of the simulator and the one function that turns them into OpenAI error bodies."""

from __future__ import annotations

import argparse
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
    """A request that fails with an HTTP status and an OpenAI-style error body."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = status if code is None else code


class RequestError(SimError):
    """The request body is invalid (status 400), like TensorRT-LLM's ValueError path."""


class TransferError(SimError):
    """The KV pull from the context executor failed (status 500 to the generation client)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, status=500)


def error_body(exc: SimError) -> dict[str, Any]:
    """TensorRT-LLM's `ErrorResponse`: {object, message, type, param, code}."""
    return {
        "object": "error",
        "message": exc.message,
        "type": _STATUS_TYPES.get(exc.status, "InternalServerError"),
        "param": exc.param,
        "code": exc.code,
    }
