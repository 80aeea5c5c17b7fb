"""Per-request perf metrics, as a trtllm-serve worker with `return_perf_metrics: true` reports them.

Two ways out, both fed by one finished request's times (the simulator's steady clock: monotonic
seconds plus the offset POSTed to `/steady_clock_offset`):

- **On the response**, when the request carries `X-TRTLLM-return-metrics: 1`
  (`tensorrt_llm/serve/perf_metrics.py` file id 56757725682: `build_request_metrics_record`,
  `build_metrics_headers`, `PerfMetricsMiddleware`, `build_metrics_sse_event`). A JSON answer
  gets the headers

      Server-Timing: server_queue;dur=1.250000, server_ttft;dur=8.500000, server_e2e;dur=24.000000
      X-TRTLLM-Start-End-Time: server-start;ts=12345.123456789, server-end;ts=12345.147456789

  (`server_kv_transfer;dur=` too on a generation leg; milliseconds with 6 decimals, timestamps
  in seconds with 9); a stream ends, after `data: [DONE]`, with
  `event: trtllm.perf_metrics\\ndata: {"Server-Timing": ..., "X-TRTLLM-Start-End-Time": ...}`.
  `X-TRTLLM-Step-Metrics` / `X-TRTLLM-Ctx-Chunk-Metrics` come from TensorRT-LLM's time-breakdown
  metrics, which the simulator does not model, so they are never sent (as upstream without them).
- **`GET /perf_metrics`**, drained on read, a ring of `perf_metrics_max_requests` records (0: the
  endpoint answers `[]`), in the shape of `openai_server.py` @fb31828e `get_perf_metrics`:

      {"request_id": n, "perf_metrics": {"first_iter", "last_iter",
          "timing_metrics": {"server_arrival_time", "arrival_time", "first_scheduled_time",
              "first_token_time", "server_first_token_time", "last_token_time",
              ["kv_cache_size", "kv_cache_transfer_start", "kv_cache_transfer_end"]},
          "kv_cache_metrics": {"num_total_allocated_blocks", "num_new_allocated_blocks",
              "num_reused_blocks", "num_missed_blocks"}},
       ["ctx_request_id": m]}

  The transfer fields appear when KV was transferred (`kv_cache_size` > 0: a generation leg
  that pulled uncached tokens); `ctx_request_id` on requests with `disaggregated_params`.

Times a request never had (no transfer) are null, as `_as_seconds` makes a zero timestamp.
"""

from __future__ import annotations

import json
from collections import deque
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shmdisagg.executors.sim.sequence import Sequence

RETURN_METRICS_HEADER = b"x-trtllm-return-metrics"  # request header, lower case as ASGI has it
SERVER_TIMING_HEADER = "Server-Timing"
START_END_TIME_HEADER = "X-TRTLLM-Start-End-Time"
SSE_METRICS_EVENT = "trtllm.perf_metrics"


def wants_metrics(headers: list[tuple[bytes, bytes]]) -> bool:
    """`X-TRTLLM-return-metrics: 1` (whitespace around the value ignored), as the middleware reads it."""
    return any(name.lower() == RETURN_METRICS_HEADER and value.strip() == b"1" for name, value in headers)


def kv_cache_size(s: Sequence, kv_bytes_per_token: float) -> int:
    """Bytes of KV a generation leg received (the tokens it did not already cache); 0 otherwise."""
    from shmdisagg.executors.sim.sequence import Kind

    if s.kind is not Kind.GENERATION_ONLY:
        return 0
    return int((s.prompt_len - s.cached_tokens) * kv_bytes_per_token)


def _ts(value: float | None) -> float | None:
    return value if value is not None and value > 0 else None


def metrics_headers(s: Sequence) -> dict[str, str]:
    """`build_metrics_headers` of the record `build_request_metrics_record` makes for `s` (phase
    "server"): names and values of the headers, only those with a value."""
    arrival = _ts(s.arrival_time)
    stamps = [
        f"server-{name};ts={value:.9f}"
        for name, value in (("start", arrival), ("end", _ts(s.last_token_time)))
        if value is not None
    ]
    timings = []
    for name, start, end in (
        ("queue", arrival, _ts(s.first_scheduled_time)),
        ("ttft", arrival, _ts(s.first_token_time)),
        ("e2e", arrival, _ts(s.last_token_time)),
        ("kv_transfer", _ts(s.transfer_start), _ts(s.transfer_end)),
    ):
        if start is not None and end is not None and end >= start:
            timings.append(f"server_{name};dur={(end - start) * 1000:.6f}")
    headers = {}
    if timings:
        headers[SERVER_TIMING_HEADER] = ", ".join(timings)
    if stamps:
        headers[START_END_TIME_HEADER] = ", ".join(stamps)
    return headers


def sse_event(headers: dict[str, str]) -> bytes:
    """`build_metrics_sse_event`: the named event a stream ends with after `data: [DONE]`."""
    if not headers:
        return b""
    return f"event: {SSE_METRICS_EVENT}\ndata: {json.dumps(headers, separators=(',', ':'))}\n\n".encode()


class PerfMetricsBuffer:
    """Finished requests' `/perf_metrics` records, oldest dropped beyond `max_requests`, drained
    on read. `max_requests` 0 keeps nothing (TensorRT-LLM creates no deque then)."""

    def __init__(self, max_requests: int, kv_bytes_per_token: float) -> None:
        self.max_requests = max_requests
        self._records: deque[dict[str, Any]] = deque(maxlen=max_requests)
        self._kv_bytes_per_token = kv_bytes_per_token

    def __len__(self) -> int:
        return len(self._records)

    def record(
        self,
        s: Sequence,
        server_arrival: float | None,
        server_first_token: float | None,
        ctx_request_id: int | None,
        has_disagg_params: bool,
    ) -> None:
        """Keep `s`'s record; the server times are the HTTP handler's (steady clock + offset)."""
        if self.max_requests <= 0:
            return
        timing: dict[str, Any] = {
            "server_arrival_time": server_arrival,
            "arrival_time": s.arrival_time,
            "first_scheduled_time": s.first_scheduled_time,
            "first_token_time": s.first_token_time,
            "server_first_token_time": server_first_token,
            "last_token_time": s.last_token_time,
        }
        size = kv_cache_size(s, self._kv_bytes_per_token)
        if size > 0:
            timing.update(
                kv_cache_size=size, kv_cache_transfer_start=s.transfer_start, kv_cache_transfer_end=s.transfer_end
            )
        rec: dict[str, Any] = {
            "request_id": s.request_id,
            "perf_metrics": {
                "first_iter": s.first_iter,
                "last_iter": s.last_iter,
                "timing_metrics": timing,
                "kv_cache_metrics": {
                    "num_total_allocated_blocks": s.total_blocks,
                    "num_new_allocated_blocks": s.new_blocks,
                    "num_reused_blocks": s.reused_blocks,
                    "num_missed_blocks": s.missed_blocks,
                },
            },
        }
        if has_disagg_params:
            rec["ctx_request_id"] = ctx_request_id
        self._records.append(rec)

    def drain(self) -> list[dict[str, Any]]:
        out = list(self._records)
        self._records.clear()
        return out
