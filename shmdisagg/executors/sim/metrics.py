"""Counters for `GET /sim/stats` (the per-request perf records are in `perf_metrics.py`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


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
