"""TensorRT-LLM's observability settings on the real request path (in process, `inprocess.py`)
against fake executors that answer `X-TRTLLM-return-metrics: 1` as TensorRT-LLM's worker does:
`return_perf_metrics` (headers / trailing SSE event to a client that asks), `perf_metrics_output_dir`
(JSONL), `otlp_config` (OpenTelemetry spans, in-memory exporter) and `TRTLLM_REQUEST_TRACE_DIR`."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from shmdisagg.metrics.jsonl import PerfMetricsJsonlWriter
from shmdisagg.observe import Observability
from shmdisagg.request_trace import RequestTraceWriter
from tests.integration.harness import FakeExecutor, deployment, fake_executors, write_config
from tests.integration.inprocess import Answer, Stack, call, run

ASK = [(b"x-trtllm-return-metrics", b"1")]
COMPLETION = {"model": "fake-model", "prompt": "hello", "max_tokens": 4}
EVENT = b"event: trtllm.perf_metrics\n"


@pytest.fixture(scope="module")
def fakes() -> Iterator[list[FakeExecutor]]:
    with fake_executors(["ctx", "gen"]) as f:
        yield f


@pytest.fixture
def stack(fakes: list[FakeExecutor], shm_prefix: str, tmp_path: Path) -> Iterator[Stack]:
    for f in fakes:
        f.script(perf_metrics=True, event_split=0, status=200, finish_reason="length")
    s = Stack(shm_prefix, fakes[0].addr, fakes[1].addr, str(tmp_path))
    yield s
    s.close()


def serve(stack: Stack, obs: Observability, requests: list[tuple[str, Any, list[tuple[bytes, bytes]]]]) -> list[Answer]:
    obs.start()
    try:

        async def go(pool: Any) -> list[Answer]:
            handler = obs.wrap(stack.service(pool).handle)
            return [await call(handler, path, body, headers) for path, body, headers in requests]

        return run(go)
    finally:
        obs.close()


def last_headers(f: FakeExecutor) -> dict[str, str]:
    """The observability headers the last leg to `f` carried (metrics request, trace context)."""
    return {k: v for k, v in f.recorded()[-1]["_headers"].items() if k in ("x-trtllm-return-metrics", "traceparent")}


# -- return_perf_metrics ------------------------------------------------------------------------


def test_a_client_that_asks_gets_every_phase_in_headers_and_the_legs_were_asked(
    stack: Stack, fakes: list[FakeExecutor]
) -> None:
    (a,) = serve(stack, Observability(expose=True), [("/v1/completions", COMPLETION, ASK)])
    assert a.status == 200
    timing, stamps = a.headers["server-timing"], a.headers["x-trtllm-start-end-time"]
    for phase in ("disagg", "ctx", "gen"):
        assert f"{phase}-start;ts=" in stamps and f"{phase}-end;ts=" in stamps
    assert "disagg_queue;dur=" in timing and "disagg_ttft;dur=" in timing
    assert "ctx_queue;dur=1.000000" in timing and "gen_ttft;dur=2.000000" in timing  # the executors' own values
    assert "server" not in timing + stamps  # renamed to their phase, as upstream does
    assert a.headers["x-trtllm-step-metrics"] == "ctx-step-0-forward;dur=0.500000, gen-step-0-forward;dur=0.500000"
    stamp = {k: float(v) for k, _, v in (item.strip().partition(";ts=") for item in stamps.split(","))}
    assert (
        stamp["disagg-start"]
        < stamp["ctx-start"]
        <= stamp["ctx-end"]
        < stamp["gen-start"]
        <= stamp["gen-end"]
        < stamp["disagg-end"]
    )
    assert last_headers(fakes[0]) == {"x-trtllm-return-metrics": "1"} and last_headers(fakes[1]) == {
        "x-trtllm-return-metrics": "1"
    }
    assert "choices" in a.json()


def test_nothing_is_added_or_asked_unless_the_client_asks_and_the_key_is_set(
    stack: Stack, fakes: list[FakeExecutor]
) -> None:
    plain, stream = serve(stack, Observability(expose=True), [
        ("/v1/completions", COMPLETION, []),
        ("/v1/completions", {**COMPLETION, "stream": True}, [(b"x-trtllm-return-metrics", b"0")])])  # fmt: skip
    assert plain.status == stream.status == 200
    assert not any(h.startswith(("server-timing", "x-trtllm-")) for h in plain.headers)
    assert stream.body.endswith(b"data: [DONE]\n\n") and EVENT not in stream.body
    assert last_headers(fakes[0]) == {} and last_headers(fakes[1]) == {}
    # return_perf_metrics off: a client's ask changes nothing (upstream's expose_headers)
    (off,) = serve(
        stack,
        Observability(tracing=None, trace_writer=None, writer=None, expose=False),
        [("/v1/completions", COMPLETION, ASK)],
    )
    assert "server-timing" not in off.headers and last_headers(fakes[1]) == {}


@pytest.mark.parametrize("split", [0, 9])
def test_a_stream_ends_with_one_metrics_event_after_done_and_never_the_executors(
    stack: Stack, fakes: list[FakeExecutor], split: int
) -> None:
    fakes[1].script(event_split=split)  # 9: the executor's event straddles two writes
    (a,) = serve(
        stack,
        Observability(expose=True),
        [
            (
                "/v1/chat/completions",
                {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "stream": True},
                ASK,
            )
        ],
    )
    assert a.status == 200 and a.body.count(EVENT) == 1
    chunks, _, event = a.body.partition(EVENT)
    assert chunks.endswith(b"data: [DONE]\n\n") and chunks.count(b"data: ") == 5  # 4 chunks + [DONE], all relayed
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    payload = orjson.loads(event[6:].strip())
    assert set(payload) == {"Server-Timing", "X-TRTLLM-Start-End-Time", "X-TRTLLM-Step-Metrics"}
    assert "disagg_ttft;dur=" in payload["Server-Timing"] and "gen_e2e;dur=" in payload["Server-Timing"]
    assert "server_" not in payload["Server-Timing"]  # the executor's own event was consumed, not relayed


def test_an_answer_the_context_leg_finished_still_gets_its_metrics(stack: Stack, fakes: list[FakeExecutor]) -> None:
    fakes[0].script(finish_reason="stop")
    plain, stream = serve(
        stack,
        Observability(expose=True),
        [("/v1/completions", COMPLETION, ASK), ("/v1/completions", {**COMPLETION, "stream": True}, ASK)],
    )
    assert "ctx_queue;dur=1.000000" in plain.headers["server-timing"] and "gen_" not in plain.headers["server-timing"]
    assert stream.body.count(EVENT) == 1 and stream.body.index(b"data: [DONE]") < stream.body.index(EVENT)


def test_an_error_answer_carries_no_metrics(stack: Stack, fakes: list[FakeExecutor]) -> None:
    fakes[0].script(status=400)
    (a,) = serve(stack, Observability(expose=True), [("/v1/completions", COMPLETION, ASK)])
    assert a.status == 400 and "server-timing" not in a.headers


# -- perf_metrics_output_dir --------------------------------------------------------------------


def test_output_dir_writes_one_upstream_record_per_request_and_asks_every_leg(
    stack: Stack, fakes: list[FakeExecutor], tmp_path: Path
) -> None:
    out = tmp_path / "perf"
    writer = PerfMetricsJsonlWriter(str(out))
    answers = serve(
        stack,
        Observability(writer=writer),
        [("/v1/completions", COMPLETION, []), ("/v1/completions", {**COMPLETION, "stream": True}, [])],
    )
    assert all(a.status == 200 for a in answers)
    assert not any(h.startswith("server-timing") for a in answers for h in a.headers)  # return_perf_metrics is off
    assert EVENT not in answers[1].body
    assert last_headers(fakes[1]) == {"x-trtllm-return-metrics": "1"}
    (path,) = out.iterdir()
    host = socket.gethostname()
    assert path.name.startswith(f"perf_metrics-disagg-{host}-") and path.suffix == ".jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["disagg_request_id"] for r in lines] == [int(a.headers["x-disagg-request-id"]) for a in answers]
    for r in lines:
        assert set(r) == {
            "ctx_server",
            "gen_server",
            "disagg_server_arrival_time",
            "disagg_ctx_dispatch_time",
            "disagg_server_first_token_time",
            "status",
            "ctx_perf_metrics",
            "gen_perf_metrics",
            "disagg_request_id",
        }
        assert (r["ctx_server"], r["gen_server"], r["status"]) == (fakes[0].addr, fakes[1].addr, "complete")
        assert r["disagg_server_arrival_time"] < r["disagg_ctx_dispatch_time"] < r["disagg_server_first_token_time"]
        for side in ("ctx_perf_metrics", "gen_perf_metrics"):
            assert r[side]["request_id"] == r["disagg_request_id"]
            timing = r[side]["perf_metrics"]["timing_metrics"]
            assert timing["first_scheduled_time"] == pytest.approx(timing["arrival_time"] + 0.001)
        # the executors' clocks are this host's CLOCK_MONOTONIC, as the orchestrator's
        assert r["disagg_ctx_dispatch_time"] < r["ctx_perf_metrics"]["perf_metrics"]["timing_metrics"]["arrival_time"]
    assert writer.written == 2 and writer.dropped_records == 0


# -- otlp_config --------------------------------------------------------------------------------


def test_spans_a_request_span_under_the_clients_trace_with_a_child_per_leg(
    stack: Stack, fakes: list[FakeExecutor]
) -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import SpanKind, StatusCode

    from shmdisagg.tracing import Tracing

    exporter, failures = InMemorySpanExporter(), InMemorySpanExporter()  # an exporter ends with its Observability
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    parent = [(b"traceparent", f"00-{trace_id}-00f067aa0ba902b7-01".encode())]
    (ok,) = serve(
        stack, Observability(tracing=Tracing.for_exporter(exporter)), [("/v1/completions", COMPLETION, parent)]
    )
    fakes[0].script(status=503)
    (failed,) = serve(
        stack, Observability(tracing=Tracing.for_exporter(failures)), [("/v1/completions", COMPLETION, [])]
    )
    assert ok.status == 200 and failed.status == 503
    spans = exporter.get_finished_spans()
    (root,) = [s for s in spans if s.name == "disaggregated_request"]
    assert root.kind == SpanKind.SERVER and format(root.context.trace_id, "032x") == trace_id
    assert root.parent is not None and format(root.parent.span_id, "016x") == "00f067aa0ba902b7"
    assert root.status.status_code == StatusCode.OK
    assert (
        root.attributes["gen_ai.request.id"] == ok.headers["x-disagg-request-id"]
        and root.attributes["http.response.status_code"] == 200
    )
    legs = [s for s in spans if s.parent is not None and s.parent.span_id == root.context.span_id]
    assert [(s.name, s.kind) for s in legs] == [("context", SpanKind.CLIENT), ("generation", SpanKind.CLIENT)]
    for leg, fake in zip(legs, fakes, strict=True):
        assert (leg.attributes["server.address"], leg.attributes["server.port"]) == ("127.0.0.1", fake.port)
        assert leg.attributes["http.response.status_code"] == 200 and leg.end_time >= leg.start_time
    assert legs[0].end_time <= legs[1].start_time
    assert "traceparent" not in last_headers(fakes[0])  # upstream's client sends none to its workers
    spans = failures.get_finished_spans()
    (bad,) = [s for s in spans if s.name == "disaggregated_request"]
    assert bad.parent is None and bad.status.status_code == StatusCode.ERROR and bad.status.description == "HTTP 503"
    (leg,) = [s for s in spans if s.parent is not None and s.parent.span_id == bad.context.span_id]
    assert (
        leg.name == "context"
        and leg.status.status_code == StatusCode.ERROR
        and leg.attributes["http.response.status_code"] == 503
    )


# -- TRTLLM_REQUEST_TRACE_DIR -------------------------------------------------------------------


def test_trace_dir_has_what_each_client_sent_and_got(stack: Stack, tmp_path: Path) -> None:
    out = tmp_path / "trace"
    writer = RequestTraceWriter(str(out))
    headers = [(b"authorization", b"Bearer sk-secret"), (b"x-session-id", b"chat/42")]
    plain, stream, bad = serve(stack, Observability(trace_writer=writer), [
        ("/v1/completions", COMPLETION, headers),
        ("/v1/completions", {**COMPLETION, "stream": True}, []),
        ("/v1/completions", {"model": "fake-model", "prompt": "x", "n": 3}, []),
    ])  # fmt: skip
    assert (plain.status, stream.status, bad.status) == (200, 200, 400)
    (bucket,) = [d for d in out.iterdir() if d.name != "_writer"]
    assert len(bucket.name) == 13 and bucket.name[10] == "T"  # the UTC hour, 2026-09-03T14
    import os

    requests = [json.loads(x) for x in (bucket / f"requests-{os.getpid()}.jsonl").read_text().splitlines()]
    responses = [json.loads(x) for x in (bucket / f"responses-{os.getpid()}.jsonl").read_text().splitlines()]
    assert [r["status"] for r in requests] == ["accepted", "accepted", "rejected_400"]
    assert len(responses) == 2  # a request refused before routing has no response line
    first = requests[0]
    assert first["event"] == "request" and first["route"] == "/v1/completions" and first["body"] == COMPLETION
    assert first["session"] == "chat_42" and requests[1]["session"] == "_no_session"
    assert ["authorization", "[redacted]"] in first["headers"] and ["x-session-id", "chat/42"] in first["headers"]
    assert requests[2]["validation_errors"][0]["loc"] == ["n"]
    by_id = {r["trace_id"]: r for r in responses}
    done = by_id[first["trace_id"]]
    assert done["status"] == "completed" and done["response"] == {"kind": "json", "body": plain.json()}
    assert done["disagg_request_id"] == int(plain.headers["x-disagg-request-id"]) and "http_status" not in done
    streamed = by_id[requests[1]["trace_id"]]
    assert streamed["response"] == {"kind": "sse_text", "body": stream.body.decode()}
    (sidecar,) = (out / "_writer").iterdir()
    books = json.loads(sidecar.read_text())
    assert books["schema"] == "trtllm-request-trace-writer/1" and books["closed"] is True
    assert books["counts"]["submitted"] == books["counts"]["persisted"] == 5 and books["counts"]["pending"] == 0
    assert sum(s["persisted_records"] for s in books["shards"]) == 5


def test_trace_dir_drops_a_body_too_deep_to_write_and_goes_on(stack: Stack, tmp_path: Path) -> None:
    """A body 1,000 levels deep (orjson reads it) passed json's encoder limit in the writer's
    thread: the RecursionError was not caught there. It is dropped as unserializable, counted,
    and the next request's records are written."""
    out = tmp_path / "trace"
    writer = RequestTraceWriter(str(out))
    deep = orjson.dumps({**COMPLETION, "x": "NESTED"}).replace(b'"NESTED"', b"[" * 1000 + b"]" * 1000)
    refused, plain = serve(stack, Observability(trace_writer=writer), [
        ("/v1/completions", deep, []),
        ("/v1/completions", COMPLETION, []),
    ])  # fmt: skip
    assert (refused.status, plain.status) == (400, 200)
    import os

    (bucket,) = [d for d in out.iterdir() if d.name != "_writer"]
    requests = [json.loads(x) for x in (bucket / f"requests-{os.getpid()}.jsonl").read_text().splitlines()]
    assert [r["body"] for r in requests] == [COMPLETION]
    (sidecar,) = (out / "_writer").iterdir()
    books = json.loads(sidecar.read_text())
    assert books["closed"] is True and books["counts"]["dropped"]["unserializable"] >= 1


# -- through a deployment -----------------------------------------------------------------------


def test_a_deployment_honours_the_keys_in_every_fleet_worker(
    fakes: list[FakeExecutor], shm_prefix: str, tmp_path: Path
) -> None:
    """The fleet workers wire it all: headers to a client that asks, and each worker's JSONL
    file, complete once the deployment stopped."""
    import http.client

    for f in fakes:
        f.script(perf_metrics=True, event_split=0, status=200, finish_reason="length")
    out = tmp_path / "perf"
    cfg = write_config(
        tmp_path,
        shm_prefix,
        [fakes[0].addr],
        [fakes[1].addr],
        return_perf_metrics=True,
        perf_metrics_output_dir=str(out),
        shmdisagg={"worker_timeout_s": 60},
    )  # a loaded machine can take >10 s to import a worker: not this test's subject
    ids = []
    with deployment(cfg) as dep:
        for i in range(6):
            c = http.client.HTTPConnection("127.0.0.1", dep.config.port, timeout=30)
            c.request(
                "POST",
                "/v1/completions",
                body=orjson.dumps({**COMPLETION, "stream": i % 2 == 1}),
                headers={"content-type": "application/json", **({"x-trtllm-return-metrics": "1"} if i < 4 else {})},
            )
            r = c.getresponse()
            body = r.read()
            c.close()
            assert r.status == 200
            ids.append(int(r.getheader("x-disagg-request-id") or 0))
            asked = i < 4
            if i % 2:
                assert (body.count(EVENT) == 1) is asked
            else:
                assert ("disagg_ttft;dur=" in (r.getheader("server-timing") or "")) is asked
    files = sorted(out.glob("perf_metrics-disagg-*.jsonl"))
    assert 1 <= len(files) <= 2  # one per fleet worker that served a request
    lines = [json.loads(line) for f in files for line in f.read_text().splitlines()]
    assert sorted(r["disagg_request_id"] for r in lines) == sorted(ids)
