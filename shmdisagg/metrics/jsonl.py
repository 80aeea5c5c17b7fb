"""`perf_metrics_output_dir`: one JSONL line per completed request, written off the event loop.

TensorRT-LLM's `PerfMetricsJsonlWriter` (`tensorrt_llm/serve/perf_metrics.py`, id 56757725682):
each serving process appends to its own file
`<dir>/perf_metrics-<kind>-<hostname>-<pid>-<UTC %Y%m%dT%H%M%SZ>.jsonl` (kind `disagg` for the
orchestrator; a fleet worker is such a process), through a bounded queue of 1024 records drained
in batches of up to 64; a full queue drops the record and counts it (`dropped_records`), and
closing flushes what is queued within 5 s. The line is `perf_record.jsonl_record`.

Here the drain is a thread, not an asyncio task: `submit` is one `put_nowait` on the event loop,
and the JSON encoding and the write happen in the thread.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

import orjson

from shmdisagg.metrics.perf_record import jsonl_record

log = logging.getLogger("shmdisagg.metrics")

QUEUE_SIZE = 1024
BATCH_SIZE = 64
SHUTDOWN_TIMEOUT_S = 5.0
_STOP = None


def jsonl_filename(kind: str, now: datetime | None = None) -> str:
    """`perf_metrics-<kind>-<host>-<pid>-<ts>.jsonl`, as upstream names the file."""
    stamp = (now or datetime.now(UTC)).strftime("%Y%m%dT%H%M%SZ")
    return f"perf_metrics-{kind}-{socket.gethostname()}-{os.getpid()}-{stamp}.jsonl"


class PerfMetricsJsonlWriter:
    """State: `path` (None until started), `written`, `dropped_records`."""

    def __init__(self, output_dir: str, server_kind: str = "disagg", queue_size: int = QUEUE_SIZE) -> None:
        self.output_dir = Path(output_dir)
        self.server_kind = server_kind
        self.path: Path | None = None
        self.written = 0
        self.dropped_records = 0
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(maxsize=queue_size)
        self._thread: threading.Thread | None = None
        self._file: TextIO | None = None

    def start(self) -> None:
        """Create the directory and the file, start the writer thread. Raises OSError."""
        if self._thread is not None:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.output_dir / jsonl_filename(self.server_kind)
        self._file = self.path.open("a", encoding="utf-8")
        self._thread = threading.Thread(target=self._run, name="perf-metrics-jsonl", daemon=True)
        self._thread.start()

    def submit(self, record: dict[str, Any]) -> None:
        """Queue one combined record (never blocks; a full queue drops it, counted)."""
        if self._thread is None:
            return
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self.dropped_records += 1
            if self.dropped_records == 1 or self.dropped_records % 1000 == 0:
                log.warning("dropped %d performance metrics records", self.dropped_records)

    def close(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Write what is queued (for at most `timeout_s`), then close the file."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        try:
            self._queue.put(_STOP, timeout=timeout_s)
        except queue.Full:
            log.warning("timed out flushing performance metrics JSONL; dropping remaining records")
        thread.join(timeout_s)
        if thread.is_alive():
            log.warning("performance metrics JSONL writer did not finish in %g s", timeout_s)
        elif self._file is not None:
            self._file.close()
            self._file = None

    def _run(self) -> None:
        stop = False
        while not stop:
            item = self._queue.get()
            if item is _STOP:
                break
            batch = [item]
            while len(batch) < BATCH_SIZE:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is _STOP:
                    stop = True
                    break
                batch.append(item)
            lines = []
            for record in batch:
                try:
                    lines.append(orjson.dumps(jsonl_record(record)).decode() + "\n")
                except (KeyError, TypeError, ValueError) as err:
                    self.dropped_records += 1
                    log.warning("dropped a malformed performance metrics record: %r", err)
            if lines and self._file is not None:
                try:
                    self._file.write("".join(lines))
                    self._file.flush()
                    self.written += len(lines)
                except OSError as err:
                    self.dropped_records += len(lines)
                    log.warning("failed to write performance metrics JSONL: %s", err)
