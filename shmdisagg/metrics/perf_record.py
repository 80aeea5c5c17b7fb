"""TensorRT-LLM's per-request perf-metrics record and its wire forms, re-implemented.

Source: `tensorrt_llm/serve/perf_metrics.py` (file id 56757725682; the list form of
`build_metrics_headers` and the one-entry-per-phase rule from its tests, ids 56725111998 and
57417599869), as used by `serve/openai_disagg_server.py` (id 70144234291) and
`serve/openai_client.py` (@00cc02a3). Nothing here does I/O; `exposure.py` calls it.

The shapes, as upstream's orchestrator builds them:

- a worker phase read from an executor's answer (`record_from_headers`): the executor's
  `Server-Timing` / `X-TRTLLM-*` values with `server_` / `server-` renamed to the phase
  (`ctx_queue;dur=...`, `ctx-start;ts=...`), kept verbatim under `metrics_headers`, plus the
  `timing_metrics` they imply (`arrival_time`, `last_token_time` from the start/end stamps;
  `first_scheduled_time`, `first_token_time` from arrival + queue / ttft);
- the request's record (`combine`): `{"schema_version": 1, "request_id": str, "status":
  "complete", "phases": {"disagg": {...}, "ctx": {...}, "gen": {...}}, "disagg_request_id"}`;
  the `disagg` phase holds `ctx_server`, `gen_server` and `timing_metrics` with
  `arrival_time`, `last_token_time`, `server_arrival_time`, `ctx_dispatch_time`,
  `server_first_token_time` (seconds on CLOCK_MONOTONIC, the steady clock the executors of
  this host stamp their own records with; None when it did not happen);
- the client's metric lists (`metrics_headers`): `Server-Timing: disagg_queue;dur=<ms>,
  disagg_ttft;dur=<ms>, ctx_queue;dur=..., ...`, `X-TRTLLM-Start-End-Time:
  disagg-start;ts=<s>, disagg-end;ts=<s>, ctx-start;ts=...`, `X-TRTLLM-Step-Metrics`,
  `X-TRTLLM-Ctx-Chunk-Metrics`; at most 80 KiB in all, else only the first two;
- the JSONL line (`jsonl_record`): `{"ctx_server", "gen_server", "disagg_server_arrival_time",
  "disagg_ctx_dispatch_time", "disagg_server_first_token_time", "status", "ctx_perf_metrics":
  {"request_id", "perf_metrics": {"timing_metrics": {...}}}, "gen_perf_metrics": ...,
  "disagg_request_id"}`;
- the trailing SSE event of a stream (`sse_event`): `event: trtllm.perf_metrics\\ndata:
  {<header name>: <value>, ...}\\n\\n`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from typing import Any

import orjson

log = logging.getLogger("shmdisagg.metrics")

SERVER_TIMING_HEADER = "Server-Timing"
START_END_TIME_HEADER = "X-TRTLLM-Start-End-Time"
STEP_METRICS_HEADER = "X-TRTLLM-Step-Metrics"
CTX_CHUNK_METRICS_HEADER = "X-TRTLLM-Ctx-Chunk-Metrics"
METRICS_HEADERS = (SERVER_TIMING_HEADER, START_END_TIME_HEADER, STEP_METRICS_HEADER, CTX_CHUNK_METRICS_HEADER)
RETURN_METRICS_HEADER = "X-TRTLLM-return-metrics"
SSE_METRICS_EVENT = "trtllm.perf_metrics"
SSE_METRICS_MARKER = f"event: {SSE_METRICS_EVENT}\n".encode()

SCHEMA_VERSION = 1
PAYLOAD_BUDGET_BYTES = 80 * 1024  # upstream's _METRICS_PAYLOAD_BUDGET_BYTES
_BY_LOWER = {name.lower().encode(): name for name in METRICS_HEADERS}

# (name, start field, end field) of the Server-Timing durations, per phase kind
_DISAGG_RANGES = (
    ("queue", "server_arrival_time", "ctx_dispatch_time"),
    ("ttft", "server_arrival_time", "server_first_token_time"),
)
_WORKER_RANGES = (
    ("queue", "arrival_time", "first_scheduled_time"),
    ("ttft", "arrival_time", "first_token_time"),
    ("e2e", "arrival_time", "last_token_time"),
    ("kv_transfer", "kv_cache_transfer_start", "kv_cache_transfer_end"),
)


def metric_headers_from_pairs(pairs: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    """The four metric headers among raw (lower-case name, value) response header pairs, under
    their canonical names."""
    out: dict[str, str] = {}
    for name, value in pairs:
        canonical = _BY_LOWER.get(name)
        if canonical is not None and canonical not in out:
            out[canonical] = value.decode("latin-1")
    return out


def record_from_headers(headers: Mapping[str, Any], phase: str, request_id: str = "") -> dict[str, Any] | None:
    """A worker phase (`phase` = "ctx" or "gen") from an executor's metric headers (the response
    headers, or the JSON object of its trailing SSE event); None when it sent none.

    Upstream: `build_metrics_record_from_headers`."""
    metrics_headers: dict[str, str] = {}
    for name in METRICS_HEADERS:
        value = headers.get(name)
        if isinstance(value, str) and value:
            metrics_headers[name] = value.replace("server_", f"{phase}_").replace("server-", f"{phase}-")
    if not metrics_headers:
        return None
    timing: dict[str, float] = {}
    stamps = {f"{phase}-start": "arrival_time", f"{phase}-end": "last_token_time"}
    for item in metrics_headers.get(START_END_TIME_HEADER, "").split(","):
        name, sep, value = item.strip().partition(";ts=")
        if sep and name in stamps:
            try:
                timing[stamps[name]] = float(value)
            except ValueError:
                log.warning("ignoring invalid %s timestamp: %s", name, value)
    durations: dict[str, float] = {}
    prefix = f"{phase}_"
    for item in metrics_headers.get(SERVER_TIMING_HEADER, "").split(","):
        name, sep, value = item.strip().partition(";dur=")
        if sep and name.startswith(prefix):
            try:
                durations[name[len(prefix) :]] = float(value) / 1000
            except ValueError:
                log.warning("ignoring invalid %s duration: %s", name, value)
    arrival = timing.get("arrival_time")
    if arrival is not None:
        for name, field in (
            ("queue", "first_scheduled_time"),
            ("ttft", "first_token_time"),
            ("e2e", "last_token_time"),
        ):
            if name in durations:
                timing.setdefault(field, arrival + durations[name])
    phase_record: dict[str, Any] = {"metrics_headers": metrics_headers}
    if timing:
        phase_record["timing_metrics"] = timing
    return {
        "schema_version": SCHEMA_VERSION,
        "request_id": request_id,
        "status": "complete",
        "metrics_headers": metrics_headers,
        "phases": {phase: phase_record},
    }


def combine(
    request_id: str,
    disagg_phase: dict[str, Any],
    ctx_record: dict[str, Any] | None,
    gen_record: dict[str, Any] | None,
    disagg_request_id: int | None = None,
) -> dict[str, Any]:
    """The request's record: the orchestrator's `disagg` phase and each worker's phase.

    Upstream: `combine_disagg_metrics`."""
    phases: dict[str, Any] = {"disagg": disagg_phase}
    for name, record in (("ctx", ctx_record), ("gen", gen_record)):
        if not record:
            continue
        phase_record = dict(next(iter(record.get("phases", {}).values()), {}))
        phase_record["request_id"] = record.get("request_id")
        if record.get("ctx_request_id") is not None:
            phase_record["ctx_request_id"] = record["ctx_request_id"]
        if record.get("metrics_headers"):
            phase_record["metrics_headers"] = record["metrics_headers"]
        phases[name] = phase_record
    combined: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "request_id": request_id,
        "status": "complete",
        "phases": phases,
    }
    if disagg_request_id is not None:
        combined["disagg_request_id"] = disagg_request_id
    return combined


def _elapsed_ms(values: Mapping[str, Any], start: str, end: str | None = None) -> float | None:
    try:
        value = float(values[start])
        if end is not None:
            value = (float(values[end]) - value) * 1000
    except (KeyError, TypeError, ValueError):
        return None
    return value if value >= 0 and math.isfinite(value) else None


def metrics_headers(records: Iterable[dict[str, Any]]) -> dict[str, str]:
    """The client's metric lists for `records`, in upstream's metric-list syntax.

    A phase that carries an executor's own lists (`metrics_headers`) contributes those and is
    not recomputed from its derived timing, so each entry appears once (upstream's tests:
    `ctx-start;` and `ctx_queue;` once in a combined record). Upstream: `build_metrics_headers`."""
    values: dict[str, list[str]] = {name: [] for name in METRICS_HEADERS}
    for record in records:
        for phase, phase_record in record.get("phases", {}).items():
            inherited = phase_record.get("metrics_headers")
            if inherited:
                for name in METRICS_HEADERS:
                    if inherited.get(name):
                        values[name].append(inherited[name])
                continue
            timing = phase_record.get("timing_metrics") or {}
            for label, field in (("start", "arrival_time"), ("end", "last_token_time")):
                stamp = timing.get(field)
                if stamp is not None:
                    values[START_END_TIME_HEADER].append(f"{phase}-{label};ts={float(stamp):.9f}")
            for name, start, end in _DISAGG_RANGES if phase == "disagg" else _WORKER_RANGES:
                took = _elapsed_ms(timing, start, end)
                if took is not None:
                    values[SERVER_TIMING_HEADER].append(f"{phase}_{name};dur={took:.6f}")
            breakdown = phase_record.get("time_breakdown_metrics") or {}
            for header, key, label in (
                (STEP_METRICS_HEADER, "step_metrics", "step"),
                (CTX_CHUNK_METRICS_HEADER, "ctx_chunk_metrics", "ctx-chunk"),
            ):
                for index, step in enumerate(breakdown.get(key, [])):
                    item = step.get("iter", index) if key == "step_metrics" else index
                    for name, took in (
                        ("forward", _elapsed_ms(step, "forward_start_time", "forward_end_time")),
                        ("sample", _elapsed_ms(step, "sample_start_time", "sample_end_time")),
                        ("gpu-forward", _elapsed_ms(step, "gpu_forward_time")),
                        ("gpu-sample", _elapsed_ms(step, "gpu_sample_time")),
                    ):
                        if took is not None:
                            values[header].append(f"{phase}-{label}-{item}-{name};dur={took:.6f}")
    return {name: ", ".join(items) for name, items in values.items() if items}


def limit_headers(headers: dict[str, str]) -> dict[str, str]:
    """`headers`, or only `Server-Timing` and `X-TRTLLM-Start-End-Time` when they exceed 80 KiB
    (upstream: `_limit_metrics_headers`)."""
    if sum(len(n) + len(v.encode()) + 4 for n, v in headers.items()) <= PAYLOAD_BUDGET_BYTES:
        return headers
    log.warning(
        "performance metrics payload exceeds %d bytes; omitting step and context-chunk metrics", PAYLOAD_BUDGET_BYTES
    )
    return {n: v for n, v in headers.items() if n in (SERVER_TIMING_HEADER, START_END_TIME_HEADER)}


def header_pairs(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    """Raw ASGI header pairs of the (limited) metric headers."""
    return [(name.encode(), value.encode()) for name, value in limit_headers(headers).items()]


def sse_event(headers: dict[str, str]) -> bytes:
    """The trailing `trtllm.perf_metrics` event of a stream (b"" when there is nothing to say).
    Upstream: `build_metrics_sse_event`."""
    headers = limit_headers(headers)
    if not headers:
        return b""
    return b"event: " + SSE_METRICS_EVENT.encode() + b"\ndata: " + orjson.dumps(headers) + b"\n\n"


def parse_sse_event(event: bytes) -> dict[str, Any] | None:
    """The JSON object of a `trtllm.perf_metrics` event (`event: ...\\ndata: {...}`), or None."""
    start = event.find(b"data: ")
    if start < 0:
        return None
    data = event[start + 6 :].split(b"\n", 1)[0]
    try:
        parsed = orjson.loads(data)
    except orjson.JSONDecodeError:
        log.warning("ignoring a malformed perf metrics event")
        return None
    return parsed if isinstance(parsed, dict) else None


def _jsonl_perf_metrics(phase_record: dict[str, Any]) -> dict[str, Any]:
    perf: dict[str, Any] = {"timing_metrics": dict(phase_record.get("timing_metrics", {}))}
    for key in ("first_iter", "last_iter", "kv_cache_metrics", "speculative_decoding"):
        if key in phase_record:
            perf[key] = phase_record[key]
    timing = perf["timing_metrics"]
    if not timing.get("kv_cache_size"):
        for name in ("kv_cache_size", "kv_cache_transfer_start", "kv_cache_transfer_end"):
            timing.pop(name, None)
    kv = dict(perf.get("kv_cache_metrics") or {})
    kv.pop("kv_cache_hit_rate", None)
    if kv:
        perf["kv_cache_metrics"] = kv
    else:
        perf.pop("kv_cache_metrics", None)
    return perf


def _jsonl_worker_metrics(request_id: Any, ctx_request_id: Any, phase_record: dict[str, Any]) -> dict[str, Any]:
    try:
        request_id = int(request_id)
    except (TypeError, ValueError):
        pass
    out: dict[str, Any] = {"request_id": request_id, "perf_metrics": _jsonl_perf_metrics(phase_record)}
    if ctx_request_id is not None:
        out["ctx_request_id"] = ctx_request_id
    if phase_record.get("time_breakdown_metrics") is not None:
        out["time_breakdown_metrics"] = phase_record["time_breakdown_metrics"]
    return out


def jsonl_record(record: dict[str, Any]) -> dict[str, Any]:
    """One JSONL line of `perf_metrics_output_dir` for a combined record (upstream: the
    disaggregated branch of `_jsonl_record`). Raises KeyError for a record without a
    `disagg` phase."""
    phases = record["phases"]
    disagg = phases["disagg"]
    timing = disagg["timing_metrics"]
    out: dict[str, Any] = {
        "ctx_server": disagg["ctx_server"],
        "gen_server": disagg["gen_server"],
        "disagg_server_arrival_time": timing["server_arrival_time"],
        "disagg_ctx_dispatch_time": timing["ctx_dispatch_time"],
        "disagg_server_first_token_time": timing["server_first_token_time"],
        "status": record.get("status", "complete"),
    }
    for phase, field in (("ctx", "ctx_perf_metrics"), ("gen", "gen_perf_metrics")):
        phase_record = phases.get(phase)
        if phase_record:
            out[field] = _jsonl_worker_metrics(
                phase_record.get("request_id", record["request_id"]), phase_record.get("ctx_request_id"), phase_record
            )
    if record.get("disagg_request_id") is not None:
        out["disagg_request_id"] = record["disagg_request_id"]
    return out
