"""Counters for `GET /sim/stats` and the per-request records behind `GET /perf_metrics`.

A `/perf_metrics` record has TensorRT-LLM's shape (timestamps on the executor's steady clock,
shifted by the offset the orchestrator POSTs to `/steady_clock_offset`):

    {"request_id": n, "ctx_request_id": m (disaggregated requests only),
     "perf_metrics": {"first_iter", "last_iter",
                      "timing_metrics": {"arrival_time", "first_scheduled_time", "first_token_time",
                                         "last_token_time",
                                         "kv_cache_size", "kv_cache_transfer_start",
                                         "kv_cache_transfer_end" (generation_only only)},
                      "kv_cache_metrics": {"num_total_allocated_blocks", "num_new_allocated_blocks",
                                           "num_reused_blocks", "num_missed_blocks",
                                           "kv_cache_hit_rate"}}}
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shmdisagg.executors.sim.sequence import Sequence


@dataclass
class Counters:
    requests: int = 0
    completed: int = 0
    errors: int = 0
    aborted: int = 0
    iterations: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefill_tokens: int = 0
    generated_tokens: int = 0
    kv_transfers: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class PerfMetricsBuffer:
    """Finished requests' records, oldest dropped beyond `max_requests`, drained on read."""

    def __init__(self, max_requests: int, kv_bytes_per_token: float) -> None:
        self._records: deque[dict[str, Any]] = deque(maxlen=max_requests)
        self._kv_bytes_per_token = kv_bytes_per_token

    def __len__(self) -> int:
        return len(self._records)

    def record(self, s: Sequence) -> None:
        from shmdisagg.executors.sim.sequence import Kind

        timing: dict[str, Any] = {
            "arrival_time": s.arrival_time,
            "first_scheduled_time": s.first_scheduled_time,
            "first_token_time": s.first_token_time,
            "last_token_time": s.last_token_time,
        }
        if s.kind is Kind.GENERATION_ONLY:
            timing["kv_cache_size"] = int((s.prompt_len - s.cached_tokens) * self._kv_bytes_per_token)
            timing["kv_cache_transfer_start"] = s.transfer_start
            timing["kv_cache_transfer_end"] = s.transfer_end
        lookups = s.reused_blocks + s.missed_blocks
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
                    "kv_cache_hit_rate": s.reused_blocks / lookups if lookups else 0.0,
                },
            },
        }
        if s.ctx_request_id is not None:
            rec["ctx_request_id"] = s.ctx_request_id
        self._records.append(rec)

    def drain(self) -> list[dict[str, Any]]:
        out = list(self._records)
        self._records.clear()
        return out
