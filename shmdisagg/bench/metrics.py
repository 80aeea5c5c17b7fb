"""Aggregates over request records, with the definitions `vllm bench serve` and AIPerf use.

* TTFT: send to the first chunk carrying non-empty text (empty first chunks are ignored, as AIPerf
  does).
* ITL: gaps between consecutive text-carrying chunks of one request, pooled over all requests
  (vLLM's ITL, AIPerf's `inter_chunk_latency`).
* TPOT: `(e2e - ttft) / (output_tokens - 1)` per request with more than one output token (vLLM's
  TPOT, AIPerf's `inter_token_latency`).
* E2E: send to the last byte of the stream (vLLM's E2EL, AIPerf's `request_latency`).
* Percentiles interpolate linearly between order statistics (numpy's default, which vLLM uses);
  `std` is the population standard deviation (numpy's default).
* Throughputs divide by the benchmark duration; only completed requests count.
* Goodput: completed requests per second meeting every given SLO (`value <= limit`); a request
  with one output token has TPOT 0, as in vLLM.
* KV cache hit rate: sum of `cached_tokens` over sum of `prompt_tokens`, over completed requests.
* Warm cache: a request reporting more cached tokens than earlier requests of the run share with
  it (`reusable_tokens`) found its prompt cached from before the run (an earlier run with the
  same `--seed`, other traffic): `cache.warm_requests`, and `cache.warm_cached_tokens` the tokens
  beyond that share.

Pure functions of records; no I/O.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from shmdisagg.bench.client import RequestRecord

PERCENTILES = (50, 90, 95, 99)

_SLO_ALIASES = {
    "ttft": "ttft",
    "time_to_first_token": "ttft",
    "tpot": "tpot",
    "inter_token_latency": "tpot",
    "e2e": "e2e",
    "e2el": "e2e",
    "request_latency": "e2e",
}


@dataclass(frozen=True, slots=True)
class Slo:
    """Goodput limits in ms; None means that metric is not constrained."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    @property
    def is_set(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2e_ms))

    def as_dict(self) -> dict[str, float]:
        return {
            name: value
            for name, value in (("ttft_ms", self.ttft_ms), ("tpot_ms", self.tpot_ms), ("e2e_ms", self.e2e_ms))
            if value is not None
        }

    def met_by(self, rec: RequestRecord) -> bool:
        if not rec.ok:
            return False
        checks = (
            (self.ttft_ms, ttft_ms(rec)),
            (self.tpot_ms, tpot_ms(rec) or 0.0),
            (self.e2e_ms, e2e_ms(rec)),
        )
        return all(limit is None or (value is not None and value <= limit) for limit, value in checks)


def parse_slo(items: Iterable[str]) -> Slo:
    """`["ttft:500", "tpot:50", "e2e:20000"]` (vLLM and AIPerf metric names accepted)."""
    limits: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        key = _SLO_ALIASES.get(name.strip().lower())
        if not sep or key is None:
            raise ValueError(f"bad --goodput item {item!r}: expected ttft:MS, tpot:MS or e2e:MS")
        try:
            limit = float(value)
        except ValueError:
            raise ValueError(f"bad --goodput value in {item!r}: not a number of ms") from None
        if not limit > 0:
            raise ValueError(f"bad --goodput value in {item!r}: must be > 0")
        limits[f"{key}_ms"] = limit
    return Slo(**limits)


# --- per-request metrics (ms) ---------------------------------------------------------------


def ttft_ms(rec: RequestRecord) -> float | None:
    if rec.first_token is None:
        return None
    return (rec.first_token - rec.send) * 1000.0


def e2e_ms(rec: RequestRecord) -> float | None:
    if rec.end is None:
        return None
    return (rec.end - rec.send) * 1000.0


def tpot_ms(rec: RequestRecord) -> float | None:
    first, out = ttft_ms(rec), rec.output_tokens
    total = e2e_ms(rec)
    if first is None or total is None or out is None or out < 2:
        return None
    return (total - first) / (out - 1)


def itls_ms(rec: RequestRecord) -> list[float]:
    t = rec.chunk_times
    return [(t[i] - t[i - 1]) * 1000.0 for i in range(1, len(t))]


# --- distributions ------------------------------------------------------------------------


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of ascending `sorted_values`, interpolating linearly."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    rank = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (rank - lo)


def distribution(values: Iterable[float]) -> dict[str, float | int | None]:
    """`count, mean, std, min, max, p50, p90, p95, p99`; all but count None when empty."""
    data = sorted(values)
    keys = ("mean", "std", "min", "max", *(f"p{q}" for q in PERCENTILES))
    if not data:
        return {"count": 0, **{k: None for k in keys}}
    mean = math.fsum(data) / len(data)
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in data) / len(data))
    out: dict[str, float | int | None] = {"count": len(data), "mean": mean, "std": std, "min": data[0], "max": data[-1]}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(data, q)
    return out


# --- the run ------------------------------------------------------------------------------


def error_kinds(records: Iterable[RequestRecord]) -> dict[str, int]:
    counts = Counter(r.error_kind for r in records if r.error_kind is not None)
    return dict(sorted(counts.items()))


def summarize(
    records: Sequence[RequestRecord], duration_s: float, slo: Slo = Slo(), cancelled: int = 0
) -> dict[str, Any]:
    """Our summary keys for a finished run (see `report.py` for the AIPerf-named view).

    `records` are the requests that finished; `cancelled` counts those cut off in flight by an
    interrupted run (sent, but neither completed nor failed)."""
    done = [r for r in records if r.ok]
    failed = len(records) - len(done)
    prompt_tokens = sum(_prompt_tokens(r) for r in done)
    output_tokens = sum(r.output_tokens or 0 for r in done)
    reporting = [r for r in done if r.cached_tokens is not None]
    cached = sum(r.cached_tokens or 0 for r in reporting)
    reported_prompt = sum(_prompt_tokens(r) for r in reporting)
    warm = [(r.cached_tokens or 0) - r.reusable_tokens for r in reporting if (r.cached_tokens or 0) > r.reusable_tokens]
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    good = sum(1 for r in done if slo.met_by(r)) if slo.is_set else None
    lags = [(r.send - r.scheduled) * 1000.0 for r in records if r.scheduled is not None]

    return {
        "requests": {
            "sent": len(records) + cancelled,
            "completed": len(done),
            "failed": failed,
            "cancelled": cancelled,
            "without_usage": sum(1 for r in done if r.usage_missing),
        },
        "duration_s": duration_s,
        "ttft_ms": distribution(v for r in done if (v := ttft_ms(r)) is not None),
        "tpot_ms": distribution(v for r in done if (v := tpot_ms(r)) is not None),
        "itl_ms": distribution(gap for r in done for gap in itls_ms(r)),
        "e2e_ms": distribution(v for r in done if (v := e2e_ms(r)) is not None),
        "input_tokens": distribution(float(_prompt_tokens(r)) for r in done),
        "output_tokens": distribution(float(r.output_tokens or 0) for r in done),
        "send_lag_ms": distribution(lags),
        "throughput": {
            "request_throughput": len(done) * per_s,
            "output_token_throughput": output_tokens * per_s,
            "total_token_throughput": (prompt_tokens + output_tokens) * per_s,
            "total_input_tokens": prompt_tokens,
            "total_output_tokens": output_tokens,
        },
        "goodput_slo": None
        if good is None
        else {
            "limits_ms": slo.as_dict(),
            "good_requests": good,
            "request_goodput": good * per_s,
        },
        "kv_cache_hit_rate": cached / reported_prompt if reported_prompt else None,
        "cache": {
            "prompt_tokens": reported_prompt,
            "cached_tokens": cached,
            "requests_reporting": len(reporting),
            "warm_requests": len(warm),
            "warm_cached_tokens": sum(warm),
        },
        "errors": {"count": failed, "kinds": error_kinds(records), "examples": _examples(records)},
    }


def _prompt_tokens(rec: RequestRecord) -> int:
    return rec.prompt_tokens if rec.prompt_tokens is not None else rec.input_length


def _examples(records: Iterable[RequestRecord]) -> dict[str, str]:
    """One message per error kind, the first seen."""
    out: dict[str, str] = {}
    for r in records:
        if r.error_kind is not None and r.error_kind not in out:
            out[r.error_kind] = r.error or ""
    return out
