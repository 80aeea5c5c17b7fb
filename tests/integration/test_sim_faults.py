"""Each injectable fault, from the command line and through POST /sim/fault."""

from __future__ import annotations

import http.client
import json
import socket
import time

import pytest

from shmdisagg.executors.sim.testing import SimProcess, get_json, post_json, request, stream_sse
from tests.conftest import free_port

BODY = {"model": "m", "prompt": [1, 2, 3, 4], "max_tokens": 4}


def start(*args: str) -> SimProcess:
    port = free_port()
    return SimProcess(["--port", str(port), "--speedup", "100", *args], port).start()


def test_crash_after_n_requests_exits_on_the_next_one():
    sim = start("--fault", "crash:after=2")
    try:
        assert post_json(sim.endpoint, "/v1/completions", BODY)[0] == 200
        assert post_json(sim.endpoint, "/v1/completions", BODY)[0] == 200
        with pytest.raises((OSError, http.client.HTTPException)):
            post_json(sim.endpoint, "/v1/completions", BODY)
        assert sim.wait_exit(10) == 1
    finally:
        sim.stop()


def test_crash_at_once_through_the_fault_endpoint():
    sim = start()
    try:
        status, body = post_json(sim.endpoint, "/sim/fault", {"kind": "crash"})
        assert status == 200 and body["faults"][0]["kind"] == "crash"
        assert sim.wait_exit(10) == 1
    finally:
        sim.stop()


def test_hang_accepts_requests_and_never_answers_until_cleared():
    sim = start()
    try:
        post_json(sim.endpoint, "/sim/fault", {"kind": "hang"})
        with pytest.raises(socket.timeout):
            request(sim.endpoint, "GET", "/health", timeout=0.5)
        with pytest.raises(socket.timeout):
            post_json(sim.endpoint, "/v1/completions", BODY, timeout=0.5)
        assert get_json(sim.endpoint, "/sim/stats")[0] == 200  # the simulator's own endpoints still answer
        post_json(sim.endpoint, "/sim/fault", {"kind": "clear"})
        assert request(sim.endpoint, "GET", "/health", timeout=5)[0] == 200
        assert post_json(sim.endpoint, "/v1/completions", BODY)[0] == 200
    finally:
        sim.stop()


def test_slow_multiplies_the_modelled_time():
    sim = start("--speedup", "10")
    try:
        body = {"model": "m", "prompt": [1, 2, 3, 4], "max_tokens": 10}
        began = time.monotonic()
        assert post_json(sim.endpoint, "/v1/completions", body)[0] == 200
        normal = time.monotonic() - began
        post_json(sim.endpoint, "/sim/fault", {"kind": "slow", "factor": 50})
        began = time.monotonic()
        assert post_json(sim.endpoint, "/v1/completions", body)[0] == 200
        slow = time.monotonic() - began
        # modelled: 50 ms overhead + 10 iterations of ~11 ms = ~160 ms, / speedup 10 = ~16 ms;
        # times 50 = ~0.8 s. Sleeps never end early, so the lower bound is safe.
        assert slow >= 0.7
        assert normal < slow / 2
    finally:
        sim.stop()


def test_error_answers_the_given_status_for_count_requests():
    sim = start("--fault", "error:status=503,count=2,message=overloaded")
    try:
        for _ in range(2):
            status, body = post_json(sim.endpoint, "/v1/completions", BODY)
            assert status == 503 and body["message"] == "overloaded" and body["object"] == "error"
        assert post_json(sim.endpoint, "/v1/completions", BODY)[0] == 200
        post_json(sim.endpoint, "/sim/fault", {"kind": "error", "status": 500})
        assert (
            post_json(
                sim.endpoint, "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}]}
            )[0]
            == 500
        )
        assert request(sim.endpoint, "GET", "/health")[0] == 200  # control endpoints are not failed
    finally:
        sim.stop()


def test_disconnect_mid_stream_cuts_the_stream_after_k_chunks():
    sim = start("--fault", "disconnect_mid_stream:after_chunks=2")
    try:
        body = {"model": "m", "prompt": [1, 2, 3, 4], "max_tokens": 8, "stream": True}
        events: list[str] = []
        with pytest.raises(http.client.HTTPException):
            for event in stream_sse(sim.endpoint, "/v1/completions", body):
                events.append(event)
        assert len(events) == 2 and "[DONE]" not in events
        assert all(json.loads(e)["choices"][0]["finish_reason"] is None for e in events)
        stats = get_json(sim.endpoint, "/sim/stats")[1]
        assert stats["counters"]["aborted"] == 1 and stats["num_running"] == 0
        post_json(sim.endpoint, "/sim/fault", {"kind": "clear"})
        assert list(stream_sse(sim.endpoint, "/v1/completions", body))[-1] == "[DONE]"
    finally:
        sim.stop()


def test_bad_fault_requests_are_refused():
    sim = start()
    try:
        status, body = post_json(sim.endpoint, "/sim/fault", {"kind": "meteor"})
        assert status == 400 and "unknown fault kind" in body["message"]
        assert post_json(sim.endpoint, "/sim/fault", {"kind": "error", "rate": 3})[0] == 400
    finally:
        sim.stop()
