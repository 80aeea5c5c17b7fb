"""The retry rules a client relies on (README, "What a client sees when things go wrong"): a
context executor's 5xx and a refused connection are retried on another server, up to
`max_retries`, with a new `disagg_request_id` for the replayed context leg; a 4xx never is."""

from __future__ import annotations

import os
import signal
import socket
import threading
from pathlib import Path

from tests.integration.harness import deployment, fake_executors, post, write_config

COMPLETION = {"model": "fake-model", "prompt": "hello", "max_tokens": 4}


def _ctx_ids(*fakes) -> list[int]:  # type: ignore[no-untyped-def]
    return [
        r["disaggregated_params"]["disagg_request_id"]
        for f in fakes
        for r in f.recorded()
        if (r.get("disaggregated_params") or {}).get("request_type") == "context_only"
    ]


def test_a_context_5xx_is_retried_on_another_server_with_a_new_request_id(tmp_path: Path, shm_prefix: str) -> None:
    with fake_executors(["c0", "c1", "g0"]) as (c0, c1, g0):
        cfg = write_config(
            tmp_path,
            shm_prefix,
            [c0.addr, c1.addr],
            [g0.addr],
            max_retries=1,
            num_workers=1,
            shmdisagg={"breaker_failures": 100},
        )  # keep c0 in the rotation: every request tries it once
        with deployment(cfg) as dep:
            c0.script(status=503)
            assert [post(dep, "/v1/completions", COMPLETION)[0] for _ in range(4)] == [200] * 4
            failed, answered = _ctx_ids(c0), _ctx_ids(c1)
            assert len(answered) == 4 and 1 <= len(failed) <= 4  # round robin sent some first to c0
            assert not set(failed) & set(answered)  # the replayed context leg carries a new id
            assert len(g0.recorded()) == 4  # every request reached generation once, from c1's answer


def test_retries_stop_at_max_retries(tmp_path: Path, shm_prefix: str) -> None:
    with fake_executors(["c0", "c1", "c2", "g0"]) as (c0, c1, c2, g0):
        cfg = write_config(
            tmp_path,
            shm_prefix,
            [c0.addr, c1.addr, c2.addr],
            [g0.addr],
            max_retries=1,
            num_workers=1,
            shmdisagg={"breaker_failures": 100},
        )
        with deployment(cfg) as dep:
            for c in (c0, c1, c2):
                c.script(status=500)
            status, body = post(dep, "/v1/completions", COMPLETION)
            assert status == 500 and body["object"] == "error"
            assert len(_ctx_ids(c0, c1, c2)) == 2  # the first try and one retry, not a third server
            assert g0.recorded() == []


def _one_context_server(tmp_path: Path, shm_prefix: str, ctx: str, gen: str) -> Path:
    """One context and one generation server, `max_retries: 1`: a retry has nowhere to go."""
    return write_config(
        tmp_path, shm_prefix, [ctx], [gen], max_retries=1, num_workers=1, shmdisagg={"breaker_failures": 100}
    )


def test_a_context_5xx_with_no_other_server_to_retry_on_is_the_clients_answer(tmp_path: Path, shm_prefix: str) -> None:
    """One context server answering 500 under `max_retries: 1`: the client gets that 500 (its
    message, redacted), not a 503 "no healthy context server" while /health says 200."""
    with fake_executors(["c0", "g0"]) as (c0, g0):
        with deployment(_one_context_server(tmp_path, shm_prefix, c0.addr, g0.addr)) as dep:
            c0.script(status=500, error_message=f"engine crashed at {c0.addr}")
            status, body = post(dep, "/v1/completions", COMPLETION)
            assert (status, body["code"], body["message"]) == (500, 500, "engine crashed at <executor>"), body
            assert len(_ctx_ids(c0)) == 1 and g0.recorded() == []
            c0.script(status=200)
            assert post(dep, "/v1/completions", COMPLETION)[0] == 200  # the pick was released


class _DroppingExecutor:
    """A context executor that answers every GET (`/health`, `/server_info`) with 200 `{}` and
    closes every POST's connection without a byte: the server is there, and drops the request."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.addr = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.dropped = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed: the test is over
                return
            with conn:
                head = conn.recv(65536)
                if head.startswith(b"GET "):
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}")
                else:
                    self.dropped += 1


def test_a_dropped_context_leg_with_no_other_server_to_retry_on_is_a_502_not_no_healthy_server(
    tmp_path: Path, shm_prefix: str
) -> None:
    """A new user's single context server dropped one connection: `max_retries: 1` looked for
    another server, found none, and answered 503 "no healthy context server" while /health said 200."""
    ctx = _DroppingExecutor()
    try:
        with fake_executors(["g0"]) as (g0,):
            with deployment(_one_context_server(tmp_path, shm_prefix, ctx.addr, g0.addr)) as dep:
                status, body = post(dep, "/v1/completions", COMPLETION)
                assert (status, body["code"]) == (502, 502), body
                assert ctx.addr not in body["message"] and ctx.dropped >= 1
    finally:
        ctx.sock.close()


def test_a_4xx_is_never_retried(tmp_path: Path, shm_prefix: str) -> None:
    with fake_executors(["c0", "c1", "g0"]) as (c0, c1, g0):
        cfg = write_config(tmp_path, shm_prefix, [c0.addr, c1.addr], [g0.addr], max_retries=3, num_workers=1)
        with deployment(cfg) as dep:
            c0.script(status=400)
            c1.script(status=400)
            status, body = post(dep, "/v1/completions", COMPLETION)
            assert status == 400 and body["code"] == 400
            assert len(_ctx_ids(c0, c1)) == 1


def test_a_refused_connection_is_retried_on_another_server(tmp_path: Path, shm_prefix: str) -> None:
    with fake_executors(["c0", "c1", "g0"]) as (c0, c1, g0):
        # a health poll slower than the test: only the refusals themselves can steer requests
        cfg = write_config(
            tmp_path,
            shm_prefix,
            [c0.addr, c1.addr],
            [g0.addr],
            max_retries=1,
            num_workers=1,
            shmdisagg={"health_check_interval_s": 60},
        )
        with deployment(cfg) as dep:
            os.kill(c0.proc.pid, signal.SIGKILL)
            c0.proc.wait()
            assert [post(dep, "/v1/completions", COMPLETION)[0] for _ in range(4)] == [200] * 4
            assert len(_ctx_ids(c1)) == 4 and len(g0.recorded()) == 4
