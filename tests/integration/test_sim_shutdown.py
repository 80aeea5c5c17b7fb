"""A simulator asked to stop (SIGTERM: the launcher's stop, or its parent-death signal when the
launcher is SIGKILLed) while a request still runs: uvicorn waits out its graceful shutdown
(`timeout_graceful_shutdown`, `executors/sim/server.py`), then cancels the request. The request
ends with an error naming the stop, and the executor's log holds no traceback (the chaos
invariant: no logged traceback after shutdown)."""

from __future__ import annotations

import http.client
import json
import signal

from shmdisagg.executors.sim.testing import SimProcess, get_json, stream_sse
from tests.conftest import free_port
from tests.integration.harness import wait_until

# speedup 1: a decode step takes milliseconds, so this many tokens outlast the graceful shutdown
BODY = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 100_000}


def start() -> SimProcess:
    port = free_port()
    return SimProcess(["--port", str(port), "--speedup", "1", "--max-seq-len", "200000"], port).start()


def test_a_stream_cut_off_by_the_graceful_shutdown_ends_with_an_error_event_and_no_traceback() -> None:
    sim = start()
    try:
        events: list[str] = []
        cut: http.client.HTTPException | None = None
        try:
            for event in stream_sse(sim.endpoint, "/v1/completions", {**BODY, "stream": True}):
                if not events:  # the request is running: the stop comes in the middle of it
                    assert sim.proc is not None
                    sim.proc.send_signal(signal.SIGTERM)
                events.append(event)
        except http.client.HTTPException as err:  # the stream closed without its last chunk
            cut = err
        sim.wait_exit(30)
        log = sim.stderr()
        assert "Traceback" not in log and "Exception in ASGI application" not in log, log
        assert cut is None
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert "shutting down" in error["message"] and error["type"] == "server_error"
        assert all("choices" in json.loads(e) for e in events[:-2])  # tokens streamed until then
    finally:
        sim.stop()


def test_a_request_cut_off_by_the_graceful_shutdown_gets_503_and_no_traceback() -> None:
    sim = start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", sim.port, timeout=30)
        conn.request("POST", "/v1/completions", json.dumps(BODY).encode(), {"content-type": "application/json"})
        wait_until(lambda: get_json(sim.endpoint, "/sim/stats")[1]["num_running"] == 1, what="the request runs")
        assert sim.proc is not None
        sim.proc.send_signal(signal.SIGTERM)
        resp = conn.getresponse()
        status, body = resp.status, json.loads(resp.read())
        conn.close()
        sim.wait_exit(30)
        log = sim.stderr()
        assert "Traceback" not in log and "Exception in ASGI application" not in log, log
        assert status == 503
        assert body["type"] == "ServiceUnavailableError" and "shutting down" in body["message"]
    finally:
        sim.stop()
