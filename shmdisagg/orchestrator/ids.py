"""Disaggregated request ids: TensorRT-LLM's snowflake layout, unique across the fleet.

Layout (TensorRT-LLM `llmapi/disagg_utils.py`, `get_global_disagg_request_id`):
`0 | timestamp_ms (39 bits) | node_id (8) | process_id (6) | counter (10)`, then rotated into
`[2**40, 2**63 - 1)` as `id % (2**63 - 1 - 2**40) + 2**40`, so ids never collide with worker-local
ids below 2**40. We take the timestamp from the wall clock (ms since 2025-01-01 UTC) rather than
the monotonic clock, so ids stay unique across restarts and reboots, and `process_id` is the fleet
worker's index (unique among live workers). When the 10-bit counter wraps inside one millisecond,
the timestamp field is advanced, keeping ids strictly increasing per process.
"""

from __future__ import annotations

import time

_EPOCH_MS = 1_735_689_600_000  # 2025-01-01T00:00:00Z
_MAX_INT64 = (1 << 63) - 1
_LOCAL_RANGE = 1 << 40


class DisaggIdGenerator:
    """Mints `disagg_request_id`s for one process (`node_id` 0..255, `process_id` 0..63)."""

    def __init__(self, node_id: int, process_id: int) -> None:
        if not 0 <= node_id < 256:
            raise ValueError("node_id must be in [0, 256)")
        if not 0 <= process_id < 64:
            raise ValueError("process_id must be in [0, 64)")
        self._fixed = (node_id << 16) | (process_id << 10)
        self._last_ms = 0
        self._counter = 0

    def next_id(self) -> int:
        """A new positive int64 id, strictly greater than the previous one from this generator."""
        now = (time.time_ns() // 1_000_000 - _EPOCH_MS) & ((1 << 39) - 1)
        if now > self._last_ms:
            self._last_ms, self._counter = now, 0
        else:
            self._counter += 1
            if self._counter == 1024:  # counter wrapped inside this ms: borrow the next ms
                self._last_ms, self._counter = self._last_ms + 1, 0
        raw = (self._last_ms << 24) | self._fixed | self._counter
        return raw % (_MAX_INT64 - _LOCAL_RANGE) + _LOCAL_RANGE
