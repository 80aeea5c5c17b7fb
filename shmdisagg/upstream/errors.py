"""The errors `UpstreamPool` raises, ordered by what a caller may do next.

- `UpstreamConnectError`: no request byte reached an executor; retrying elsewhere is safe.
- `UpstreamDisconnected`: the connection dropped after the request was written. With
  `bytes_received == 0` no response byte arrived (the executor may or may not have started the
  work); with `bytes_received > 0` part of a response was seen and the exchange must not be
  replayed.
- `UpstreamTimeout`: no response head within the request's `timeout_s`; the work may be running.
- `UpstreamProtocolError`: the executor's bytes broke HTTP/1.1 or this pool's size limits.
"""

from __future__ import annotations

__all__ = [
    "UpstreamConnectError",
    "UpstreamDisconnected",
    "UpstreamError",
    "UpstreamProtocolError",
    "UpstreamTimeout",
]


class UpstreamError(Exception):
    """Base of every error raised while talking to an executor."""


class UpstreamConnectError(UpstreamError):
    """Connection refused, name resolution failed, connect timed out, or the pool is closed.

    Nothing was sent, so the request can be retried on another executor.
    """


class UpstreamDisconnected(UpstreamError):
    """The connection closed before the response was complete (peer reset, EOF, local abort).

    Attributes:
        bytes_received: raw response bytes (head and body) that arrived before the drop.
    """

    def __init__(self, message: str, bytes_received: int) -> None:
        super().__init__(message)
        self.bytes_received = bytes_received


class UpstreamTimeout(UpstreamError):
    """The response head did not arrive within the request's `timeout_s`; the connection is closed."""


class UpstreamProtocolError(UpstreamError):
    """Malformed HTTP from the executor, a head over the size limit, or a body over `max_response_bytes`.

    The connection is closed.
    """
