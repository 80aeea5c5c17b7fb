"""TensorRT-LLM's per-request record (shmdisagg/metrics/perf_record.py) and the SSE filter that
keeps an executor's trailing metrics event from the client (shmdisagg/observe.py). The expected
strings are the ones upstream's own tests assert (tests of tensorrt_llm/serve/perf_metrics.py,
ids 56725111998, 57417599869)."""

from __future__ import annotations

import orjson
import pytest

from shmdisagg.metrics import perf_record as pr
from shmdisagg.observe import MetricsEventFilter


def worker_record() -> dict:
    """Upstream's test record: a phase `server` with one step and one context chunk."""
    return {
        "schema_version": 1,
        "request_id": "42",
        "status": "complete",
        "phases": {"server": {
            "timing_metrics": {"arrival_time": 1.0, "first_scheduled_time": 1.01, "first_token_time": 1.02,
                               "last_token_time": 1.05, "kv_cache_transfer_start": None, "kv_cache_transfer_end": None},
            "time_breakdown_metrics": {
                "step_metrics": [{"iter": 3, "forward_start_time": 2.0, "forward_end_time": 2.002,
                                  "sample_start_time": 2.002, "sample_end_time": 2.003, "gpu_forward_time": 1.5,
                                  "gpu_sample_time": 0.5}],
                "ctx_chunk_metrics": [{"forward_start_time": 1.0, "forward_end_time": 1.004, "sample_start_time": 1.004,
                                       "sample_end_time": 1.005, "gpu_forward_time": 3.0, "gpu_sample_time": 0.25}],
            },
        }},
    }  # fmt: skip


def test_metric_lists_use_upstream_syntax() -> None:
    headers = pr.metrics_headers([worker_record()])
    assert "server_queue;dur=10.000000" in headers[pr.SERVER_TIMING_HEADER]
    assert "server_ttft;dur=20.000000" in headers[pr.SERVER_TIMING_HEADER]
    assert "server_e2e;dur=50.000000" in headers[pr.SERVER_TIMING_HEADER]
    assert "server-start;ts=1.000000000" in headers[pr.START_END_TIME_HEADER]
    assert "server-end;ts=1.050000000" in headers[pr.START_END_TIME_HEADER]
    assert "server-step-3-forward;dur=2.000000" in headers[pr.STEP_METRICS_HEADER]
    assert "server-step-3-gpu-sample;dur=0.500000" in headers[pr.STEP_METRICS_HEADER]
    assert "server-ctx-chunk-0-forward;dur=4.000000" in headers[pr.CTX_CHUNK_METRICS_HEADER]


def test_a_combined_record_lists_each_phase_once_and_round_trips_to_jsonl() -> None:
    worker = pr.metrics_headers([worker_record()])
    ctx = pr.record_from_headers(worker, "ctx", "42")
    gen = pr.record_from_headers(worker, "gen", "42")
    assert ctx is not None and gen is not None
    assert ctx["phases"]["ctx"]["timing_metrics"] == pytest.approx(
        {"arrival_time": 1.0, "last_token_time": 1.05, "first_scheduled_time": 1.01, "first_token_time": 1.02}
    )
    disagg = {"ctx_server": "ctx:8000", "gen_server": "gen:8000", "timing_metrics": {
        "arrival_time": 0.99, "last_token_time": 1.1, "server_arrival_time": 0.99, "ctx_dispatch_time": 1.0,
        "server_first_token_time": 1.03}}  # fmt: skip
    record = pr.combine("42", disagg, ctx, gen, disagg_request_id=42)
    assert set(record["phases"]) == {"disagg", "ctx", "gen"}
    headers = pr.metrics_headers([record])
    timing, stamps = headers[pr.SERVER_TIMING_HEADER], headers[pr.START_END_TIME_HEADER]
    assert timing.count("ctx_queue;") == 1 and stamps.count("ctx-start;") == 1
    assert "disagg_queue;dur=10.000000" in timing and "disagg_ttft;dur=40.000000" in timing
    assert "disagg-start;ts=0.990000000" in stamps and "server" not in timing + stamps
    assert "gen-step-3-forward;dur=2.000000" in headers[pr.STEP_METRICS_HEADER]

    line = pr.jsonl_record(record)
    assert line["disagg_server_arrival_time"] == 0.99 and line["disagg_ctx_dispatch_time"] == 1.0
    assert line["disagg_server_first_token_time"] == 1.03 and line["disagg_request_id"] == 42
    assert line["ctx_perf_metrics"]["request_id"] == 42  # an integer, as upstream writes it
    assert line["gen_perf_metrics"]["perf_metrics"]["timing_metrics"]["first_token_time"] == pytest.approx(1.02)
    assert (line["ctx_server"], line["gen_server"], line["status"]) == ("ctx:8000", "gen:8000", "complete")


def test_metrics_over_the_budget_keep_only_timing_and_stamps() -> None:
    record = worker_record()
    breakdown = record["phases"]["server"]["time_breakdown_metrics"]
    breakdown["step_metrics"] *= 2000
    breakdown["ctx_chunk_metrics"] *= 2000
    kept = dict(pr.header_pairs(pr.metrics_headers([record])))
    assert set(kept) == {b"Server-Timing", b"X-TRTLLM-Start-End-Time"}
    event = pr.sse_event(pr.metrics_headers([record]))
    assert event.startswith(b"event: trtllm.perf_metrics\ndata: ") and set(pr.parse_sse_event(event) or {}) == {
        "Server-Timing",
        "X-TRTLLM-Start-End-Time",
    }


def test_no_metric_headers_make_no_phase() -> None:
    assert pr.record_from_headers({}, "ctx") is None
    assert pr.metric_headers_from_pairs([(b"content-type", b"application/json")]) == {}
    assert pr.metric_headers_from_pairs([(b"server-timing", b"server_queue;dur=1")]) == {
        "Server-Timing": "server_queue;dur=1"
    }


EVENT = b"event: trtllm.perf_metrics\ndata: " + orjson.dumps({"Server-Timing": "server_queue;dur=1.000000"}) + b"\n\n"
STREAM = b'data: {"a":1}\n\ndata: {"a":2}\n\ndata: [DONE]\n\n'


@pytest.mark.parametrize(
    "cuts",
    [(), (len(STREAM),), (len(STREAM) + 5,), (3, 20, len(STREAM) + 12), tuple(range(1, len(STREAM) + len(EVENT)))],
)
def test_the_filter_relays_the_stream_and_keeps_the_event_however_it_is_split(cuts: tuple[int, ...]) -> None:
    data = STREAM + EVENT
    bounds = [0, *cuts, len(data)]
    f = MetricsEventFilter()
    out = b"".join(f.feed(data[a:b]) for a, b in zip(bounds, bounds[1:], strict=False))
    tail, event = f.finish()
    assert out + tail == STREAM and event == EVENT
    assert pr.parse_sse_event(event) == {"Server-Timing": "server_queue;dur=1.000000"}


def test_the_filter_passes_a_stream_without_an_event_and_whole_events_at_once() -> None:
    f = MetricsEventFilter()
    assert f.feed(b'data: {"a":1}\n\n') == b'data: {"a":1}\n\n'  # a whole event is not held back
    assert f.feed(b'data: {"a"') == b""
    assert f.feed(b":2}\n\ndata: [DONE]\n\n") == b'data: {"a":2}\n\ndata: [DONE]\n\n'
    assert f.finish() == (b"", b"")
