"""Per-request perf metrics in the shapes of TensorRT-LLM's serve/perf_metrics.py (file id 56757725682)
and `/perf_metrics` records as openai_server.py @fb31828e writes them."""

from __future__ import annotations

import json

from shmdisagg.executors.sim.perf_metrics import PerfMetricsBuffer, metrics_headers, sse_event, wants_metrics
from shmdisagg.executors.sim.sequence import Kind, Sequence


def finished(kind: Kind = Kind.LOCAL, **times: float) -> Sequence:
    s = Sequence(request_id=7, kind=kind, prompt=list(range(100)), prompt_seed=1, max_tokens=4)
    s.arrival_time, s.first_scheduled_time, s.first_token_time, s.last_token_time = 1.0, 1.01, 1.02, 1.05
    for k, v in times.items():
        setattr(s, k, v)
    return s


def test_headers_use_servers_metric_list_syntax():
    headers = metrics_headers(finished())
    assert headers == {
        "Server-Timing": "server_queue;dur=10.000000, server_ttft;dur=20.000000, server_e2e;dur=50.000000",
        "X-TRTLLM-Start-End-Time": "server-start;ts=1.000000000, server-end;ts=1.050000000",
    }
    transfer = metrics_headers(finished(Kind.GENERATION_ONLY, transfer_start=1.0, transfer_end=1.004))
    assert transfer["Server-Timing"].endswith(", server_kv_transfer;dur=4.000000")


def test_missing_times_are_left_out():
    headers = metrics_headers(finished(first_token_time=0.0, last_token_time=None))  # type: ignore[arg-type]
    assert headers == {
        "Server-Timing": "server_queue;dur=10.000000",
        "X-TRTLLM-Start-End-Time": "server-start;ts=1.000000000",
    }


def test_the_sse_event_and_the_request_header():
    event = sse_event({"Server-Timing": "server_e2e;dur=1.000000"})
    assert event == b'event: trtllm.perf_metrics\ndata: {"Server-Timing":"server_e2e;dur=1.000000"}\n\n'
    assert sse_event({}) == b""
    assert wants_metrics([(b"X-TRTLLM-return-metrics", b" 1 ")])
    assert not wants_metrics([(b"x-trtllm-return-metrics", b"true")]) and not wants_metrics([])


def test_perf_metrics_records_and_their_ring():
    buf = PerfMetricsBuffer(2, kv_bytes_per_token=10.0)
    buf.record(finished(), 0.9, 1.03, None, has_disagg_params=False)
    gen = finished(Kind.GENERATION_ONLY, transfer_start=1.0, transfer_end=1.004)
    gen.cached_tokens = 40
    buf.record(gen, 0.9, 1.03, 5, has_disagg_params=True)
    buf.record(gen, 0.9, 1.03, 6, has_disagg_params=True)
    first, second = buf.drain()  # the oldest was dropped
    assert len(buf) == 0 and first["ctx_request_id"] == 5 and second["ctx_request_id"] == 6
    timing = first["perf_metrics"]["timing_metrics"]
    assert list(timing) == [
        "server_arrival_time",
        "arrival_time",
        "first_scheduled_time",
        "first_token_time",
        "server_first_token_time",
        "last_token_time",
        "kv_cache_size",
        "kv_cache_transfer_start",
        "kv_cache_transfer_end",
    ]
    assert timing["kv_cache_size"] == 600  # (100 - 40) tokens x 10 bytes
    json.dumps(first)  # JSON-safe
    nothing = PerfMetricsBuffer(0, 10.0)
    nothing.record(finished(), 0.9, 1.03, None, has_disagg_params=False)
    assert nothing.drain() == []
