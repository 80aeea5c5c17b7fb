"""uvicorn glue shared by the fleet worker and the coordinator."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable, Generator

import uvicorn


class EmbeddedServer(uvicorn.Server):
    """A uvicorn server that leaves signal handling to its process.

    uvicorn's `capture_signals` re-raises SIGTERM/SIGINT after shutdown, which would kill the
    process before its own ordered clean-up runs; our processes install their own handlers.
    """

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def on_stop_signals(callback: Callable[..., None], with_signal: bool = False) -> None:
    """Call `callback` (in the running loop) on SIGTERM or SIGINT; `with_signal`: with the
    signal's number as its argument."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, callback, *((sig,) if with_signal else ()))
