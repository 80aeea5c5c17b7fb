"""Request lifecycle under faults and bad input: what the client sees, and that no load leaks."""

from __future__ import annotations

import http.client
import os
import signal
import socket
import stat
import threading
import time
from pathlib import Path

import orjson
import pytest

from shmdisagg.shm.table import ControlTable
from shmdisagg.stats.snapshot import StatsReader, snapshot
from tests.integration.harness import (
    deployment,
    fake_executors,
    post,
    post_raw,
    request_json,
    stream_lines,
    wait_until,
    write_config,
)

COMPLETION = {"model": "fake-model", "prompt": "hello", "max_tokens": 4}


def _idle(dep) -> bool:  # type: ignore[no-untyped-def]
    with ControlTable.attach(dep.config.shm_prefix) as table:
        return all(table.load(s.slot) == (0, 0) for s in table.servers())


@pytest.fixture
def pair(tmp_path: Path, shm_prefix: str, request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    extra = getattr(request, "param", {})
    with fake_executors(["c0", "g0", "g1"]) as (ctx, g0, g1):
        cfg = write_config(
            tmp_path, shm_prefix, [ctx.addr], [g0.addr, g1.addr], routers=("round_robin", "load_balancing"), **extra
        )
        with deployment(cfg) as dep:
            yield dep, ctx, g0, g1


def test_client_disaggregated_params_never_reach_an_executor(pair) -> None:  # type: ignore[no-untyped-def]
    """A client's own `disaggregated_params` is the orchestrator's field: refused by name with a
    400, and nothing reaches an executor; the orchestrator's own params still flow."""
    dep, ctx, g0, g1 = pair
    body = {**COMPLETION, "disaggregated_params": {"request_type": "generation_only", "ctx_request_id": 1}}
    status, err = post(dep, "/v1/completions", body)
    assert status == 400 and "disaggregated_params" in err["message"]
    assert ctx.recorded() == [] and g0.recorded() + g1.recorded() == []
    assert post(dep, "/v1/completions", COMPLETION)[0] == 200
    [c] = ctx.recorded()
    assert (
        c["disaggregated_params"]["request_type"] == "context_only"
        and "ctx_request_id" not in c["disaggregated_params"]
    )
    [g] = g0.recorded() + g1.recorded()
    assert g["disaggregated_params"]["ctx_request_id"] == c["disaggregated_params"]["disagg_request_id"]


def test_context_stop_without_ids_is_final(pair) -> None:  # type: ignore[no-untyped-def]
    dep, ctx, g0, g1 = pair
    ctx.script(finish_reason="stop", omit_ids=True)
    status, body = post(dep, "/v1/completions", COMPLETION)
    assert status == 200 and body["choices"][0]["finish_reason"] == "stop"
    assert g0.recorded() == g1.recorded() == []


def test_context_length_without_ids_is_a_502_not_a_generation_call(pair) -> None:  # type: ignore[no-untyped-def]
    dep, ctx, g0, g1 = pair
    ctx.script(omit_ids=True)
    status, body = post(dep, "/v1/completions", COMPLETION)
    assert status == 502 and body["object"] == "error"
    assert g0.recorded() == g1.recorded() == []
    assert _idle(dep)


@pytest.mark.parametrize("stream", [False, True])
def test_generation_killed_mid_stream_ends_the_stream_and_is_avoided(pair, stream: bool) -> None:  # type: ignore[no-untyped-def]
    dep, ctx, g0, g1 = pair
    for g in (g0, g1):
        g.script(hold=True) if stream else g.script(delay_s=30)
    result: dict = {}

    def run() -> None:
        t0 = time.monotonic()
        if stream:
            result["status"], result["events"], _ = stream_lines(dep, "/v1/completions", {**COMPLETION, "stream": True})
        else:
            result["status"], result["body"] = post(dep, "/v1/completions", COMPLETION)
        result["took"] = time.monotonic() - t0

    client = threading.Thread(target=run)
    client.start()
    wait_until(lambda: len(g0.recorded()) + len(g1.recorded()) == 1, what="the generation leg")
    victim, survivor = (g0, g1) if g0.recorded() else (g1, g0)
    killed_at = time.monotonic()
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait()
    client.join(timeout=20)
    assert not client.is_alive() and result["took"] < 15
    if stream:
        # the stream had started: an SSE error event, then [DONE]
        assert result["status"] == 200
        assert b"error" in result["events"][-2] and result["events"][-1] == b"[DONE]"
    else:
        assert result["status"] == 502
    assert time.monotonic() - killed_at < 5
    survivor.script(hold=False, delay_s=0)
    # the next requests avoid the dead server (the coordinator marks it unhealthy for the fleet)
    wait_until(lambda: _unhealthy(dep, victim.addr), timeout_s=2, what="the dead server marked unhealthy")
    for _ in range(4):
        assert post(dep, "/v1/completions", COMPLETION)[0] == 200
    wait_until(lambda: _idle(dep), timeout_s=5, what="load released")


def _unhealthy(dep, addr: str) -> bool:  # type: ignore[no-untyped-def]
    with ControlTable.attach(dep.config.shm_prefix) as table:
        return any(s.addr == addr and not s.healthy for s in table.servers())


def test_generation_400_reaches_the_client_and_is_not_retried(pair) -> None:  # type: ignore[no-untyped-def]
    dep, ctx, g0, g1 = pair
    for g in (g0, g1):
        g.script(status=400)
    status, body = post(dep, "/v1/completions", COMPLETION)
    assert status == 400 and body["message"] == "scripted 400"
    assert len(g0.recorded()) + len(g1.recorded()) == 1
    assert _idle(dep)

    # `shmdisagg stats` shows it as the client's 4xx, not as a failure of the deployment
    def requests() -> dict:  # type: ignore[type-arg]
        with StatsReader(dep.config.shm_prefix) as reader:
            return snapshot(None, reader.sample(), dep.config.shm_prefix)["requests"]

    wait_until(lambda: requests()["in_flight"] == 0, what="the request's end counted")
    req = requests()
    assert (req["client_errors"], req["failed"], req["http_exceptions"]) == (1, 0, 1)


@pytest.mark.parametrize("pair", [{"shmdisagg": {"request_timeout_s": 1.5}}], indirect=True)
def test_stopped_executors_cannot_outlive_the_deadline(pair) -> None:  # type: ignore[no-untyped-def]
    dep, ctx, g0, g1 = pair
    procs = [ctx.proc, g0.proc, g1.proc]
    for p in procs:
        os.kill(p.pid, signal.SIGSTOP)
    try:
        results: list = []
        threads = [
            threading.Thread(
                target=lambda s=s: results.append(
                    (
                        s,
                        time.monotonic(),
                        (stream_lines if s else post)(dep, "/v1/completions", {**COMPLETION, "stream": s}),
                    )
                )
            )
            for s in (False, True, False, True)
        ]
        started = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=20)
        assert len(results) == 4
        for _stream, ended, resp in results:
            assert ended - started < 1.5 + 2.0  # the deadline plus scheduling slack
            assert resp[0] == 504  # nothing was sent yet: a JSON 504, streaming or not
    finally:
        for p in procs:
            os.kill(p.pid, signal.SIGCONT)
    wait_until(lambda: _idle(dep), timeout_s=5, what="load released")


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_cancels_upstream_and_releases_within_100ms(pair, stream: bool) -> None:  # type: ignore[no-untyped-def]
    dep, ctx, g0, g1 = pair
    for g in (g0, g1):
        g.script(hold=True) if stream else g.script(delay_s=30)
    sock = socket.create_connection(("127.0.0.1", dep.config.port))
    body = orjson.dumps({**COMPLETION, "stream": stream})
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
        % (len(body), body)
    )
    wait_until(lambda: len(g0.recorded()) + len(g1.recorded()) == 1, what="the generation leg")
    if stream:
        sock.recv(1)  # the stream has started
    assert not _idle(dep)
    sock.close()
    closed_at = time.monotonic()
    wait_until(lambda: _idle(dep), timeout_s=5, what="load released")
    # 100 ms for the release itself, plus slack for this polling test process on a busy machine
    assert time.monotonic() - closed_at < 0.1 + 0.1
    if stream:
        gen = g0 if g0.recorded() else g1
        wait_until(
            lambda: any(e.startswith("cancelled") for e in gen.events()),
            timeout_s=2,
            what="the upstream stream cancelled",
        )


@pytest.mark.parametrize("pair", [{"shmdisagg": {"max_inflight_requests": 1}}], indirect=True)
def test_admission_limit_answers_429_with_retry_after_at_once(pair) -> None:  # type: ignore[no-untyped-def]
    dep, ctx, g0, g1 = pair
    for g in (g0, g1):
        g.script(hold=True)
    held = threading.Thread(target=stream_lines, args=(dep, "/v1/completions", {**COMPLETION, "stream": True}))
    held.start()
    wait_until(lambda: len(g0.recorded()) + len(g1.recorded()) == 1, what="the held request")
    c = http.client.HTTPConnection("127.0.0.1", dep.config.port, timeout=5)
    t0 = time.monotonic()
    c.request("POST", "/v1/completions", body=orjson.dumps(COMPLETION), headers={"content-type": "application/json"})
    r = c.getresponse()
    body = orjson.loads(r.read())
    assert r.status == 429 and r.getheader("retry-after") == "1" and body["code"] == 429
    assert time.monotonic() - t0 < 1.0
    c.close()
    assert len(ctx.recorded()) == 1  # the rejected request reached no executor
    for g in (g0, g1):
        g.release()
    held.join(timeout=20)
    assert post(dep, "/v1/completions", COMPLETION)[0] == 200


@pytest.mark.parametrize("pair", [{"shmdisagg": {"max_request_body_bytes": 2048}}], indirect=True)
def test_request_hygiene(pair) -> None:  # type: ignore[no-untyped-def]
    dep, ctx, g0, g1 = pair
    status, body = post_raw(dep, "/v1/completions", orjson.dumps({**COMPLETION, "prompt": "x" * 4096}))
    assert status == 413 and body["object"] == "error"
    c = http.client.HTTPConnection("127.0.0.1", dep.config.port, timeout=5)
    for odd in ("has spaces; and=more", "x" * 200, "a{b}"):  # served, as TensorRT-LLM serves it, not echoed
        c.request(
            "POST",
            "/v1/completions",
            body=orjson.dumps(COMPLETION),
            headers={"content-type": "application/json", "x-request-id": odd},
        )
        r = c.getresponse()
        r.read()
        assert r.status == 200 and r.getheader("x-request-id") is None
    c.request(
        "POST",
        "/v1/completions",
        body=orjson.dumps(COMPLETION),
        headers={"content-type": "application/json", "x-request-id": "abc-123"},
    )
    r = c.getresponse()
    r.read()
    assert r.status == 200 and r.getheader("x-request-id") == "abc-123"
    c.close()
    assert len(ctx.recorded()) == 4
    assert _idle(dep)


def test_health_is_503_while_a_role_has_no_healthy_server_and_200_when_one_returns(
    tmp_path: Path, shm_prefix: str
) -> None:
    with fake_executors(["c0", "g0"]) as (ctx, gen):
        cfg = write_config(tmp_path, shm_prefix, [ctx.addr], [gen.addr])
        with deployment(cfg) as dep:
            port = dep.config.port
            os.kill(gen.proc.pid, signal.SIGSTOP)  # stops answering: failed health polls
            try:
                wait_until(
                    lambda: request_json("127.0.0.1", port, "GET", "/health")[0] == 503, timeout_s=5, what="health 503"
                )
                status, body = post(dep, "/v1/completions", COMPLETION)
                assert status == 503 and body["code"] == 503
            finally:
                os.kill(gen.proc.pid, signal.SIGCONT)
            wait_until(
                lambda: request_json("127.0.0.1", port, "GET", "/health")[0] == 200,
                timeout_s=5,
                what="health 200 again",
            )
            assert post(dep, "/v1/completions", COMPLETION)[0] == 200


def test_generation_first_from_the_environment_dispatches_generation_before_context_answers(
    tmp_path: Path, shm_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRTLLM_DISAGG_SCHEDULE_STYLE", "generation_first")  # overrides the file's context_first
    with fake_executors(["c0", "g0"]) as (ctx, gen):
        cfg = write_config(tmp_path, shm_prefix, [ctx.addr], [gen.addr], schedule_style="context_first")
        with deployment(cfg) as dep:
            assert (
                request_json("127.0.0.1", dep.config.port, "GET", "/server_info")[1]["schedule_style"]
                == "generation_first"
            )
            ctx.script(delay_s=3.0)
            result: dict = {}
            t = threading.Thread(
                target=lambda: result.update(r=stream_lines(dep, "/v1/completions", {**COMPLETION, "stream": True}))
            )
            t0 = time.monotonic()
            t.start()
            wait_until(lambda: len(gen.recorded()) == 1, what="the generation leg")
            assert time.monotonic() - t0 < 2.5  # sent while the context leg was still running
            t.join(timeout=20)
            assert result["r"][0] == 200 and result["r"][1][-1] == b"[DONE]"
            [c], [g] = ctx.recorded(), gen.recorded()
            cp, gp = c["disaggregated_params"], g["disaggregated_params"]
            assert cp["request_type"] == "context_only" and cp["schedule_style"] == 1
            assert gp["request_type"] == "generation_only" and gp["schedule_style"] == 1
            assert gp["ctx_request_id"] == gp["disagg_request_id"] == cp["disagg_request_id"]
            assert gp["ctx_info_endpoint"] == ctx.addr  # the advertised list, collapsed
            assert gp["encoded_opaque_state"] == "b3BhcXVl"  # copied from the context server's /server_info
            assert g["prompt"] == "hello"  # no context response to take token ids from
            assert _idle(dep)


def test_generation_first_context_failure_cancels_the_generation_leg(tmp_path: Path, shm_prefix: str) -> None:
    with fake_executors(["c0", "g0"]) as (ctx, gen):
        cfg = write_config(tmp_path, shm_prefix, [ctx.addr], [gen.addr], schedule_style="generation_first")
        with deployment(cfg) as dep:
            ctx.script(status=400, delay_s=0.3)
            gen.script(hold=True)
            status, events, _ = stream_lines(dep, "/v1/completions", {**COMPLETION, "stream": True})
            assert status == 400
            wait_until(
                lambda: any(e.startswith("cancelled") for e in gen.events()),
                timeout_s=3,
                what="the generation leg cancelled",
            )
            assert _idle(dep)


def test_reported_request_failures_open_the_breaker_then_the_server_is_readmitted(
    tmp_path: Path, shm_prefix: str
) -> None:
    import asyncio

    import aiohttp

    with fake_executors(["c0", "g0", "g1"]) as (ctx, g0, g1):
        cfg = write_config(
            tmp_path,
            shm_prefix,
            [ctx.addr],
            [g0.addr, g1.addr],
            # a cool-down long enough for the three requests below on a loaded machine (1 s
            # readmitted g1 before the third one in a CI run)
            shmdisagg={"breaker_failures": 3, "breaker_cooldown_s": 5.0},
        )
        with deployment(cfg) as dep:
            slot = next(s.slot for s in ControlTable.attach(dep.config.shm_prefix).servers() if s.addr == g1.addr)

            async def report() -> dict:
                conn = aiohttp.UnixConnector(path=dep.config.coordinator_socket)
                async with aiohttp.ClientSession(connector=conn) as session:
                    async with session.post(
                        "http://coordinator/report", json=[{"slot": slot, "kind": "error"}] * 3
                    ) as r:
                        assert r.status == 200
                        return await r.json()

            assert asyncio.run(report()) == {"accepted": 3}
            assert _unhealthy(dep, g1.addr)  # the breaker opened at once, for the whole fleet
            for _ in range(3):
                status, resp = post(dep, "/v1/completions", COMPLETION)
                assert status == 200 and resp["id"] == "cmpl-g0"
            wait_until(lambda: not _unhealthy(dep, g1.addr), timeout_s=20, what="re-admission after the cool-down")


def test_the_coordinators_api_socket_is_private_to_its_user(pair) -> None:  # type: ignore[no-untyped-def]
    # its unauthenticated POST /report marks servers down: no other user may connect
    dep, *_ = pair
    st = os.stat(dep.config.coordinator_socket)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600, oct(st.st_mode)
    assert st.st_uid == os.getuid()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:  # and it still serves the API
        s.settimeout(10)
        s.connect(dep.config.coordinator_socket)
        s.sendall(b"GET /cluster_info HTTP/1.1\r\nhost: coordinator\r\nconnection: close\r\n\r\n")
        assert s.recv(64).startswith(b"HTTP/1.1 200 ")


def test_unknown_routes_and_methods_get_openai_error_bodies(pair) -> None:  # type: ignore[no-untyped-def]
    dep, *_ = pair
    status, body = request_json("127.0.0.1", dep.config.port, "GET", "/v1/completions")
    assert status == 405 and body["object"] == "error" and body["code"] == 405
    status, body = request_json("127.0.0.1", dep.config.port, "GET", "/no/such/route")
    assert status == 404 and body["object"] == "error" and body["code"] == 404


def test_a_conversation_header_reaches_both_executors_in_conversation_params(pair) -> None:  # type: ignore[no-untyped-def]
    """TensorRT-LLM's serve edge copies the first non-empty conversation header into the body's
    `conversation_params` (executors never see the client's headers); a body's own id wins."""
    dep, ctx, g0, g1 = pair

    def send(body: dict, headers: dict[str, str]) -> None:  # type: ignore[type-arg]
        c = http.client.HTTPConnection("127.0.0.1", dep.config.port, timeout=30)
        try:
            c.request(
                "POST",
                "/v1/completions",
                body=orjson.dumps(body),
                headers={"content-type": "application/json", **headers},
            )
            assert c.getresponse().status == 200
        finally:
            c.close()

    send(COMPLETION, {"x-session-id": "  ", "X-Correlation-ID": " conv-7 "})  # blank: the next header
    send({**COMPLETION, "conversation_params": {"conversation_id": "body-id"}}, {"x-session-id": "header-id"})
    send(COMPLETION, {})
    legs = [ctx.recorded(), g0.recorded() + g1.recorded()]
    for role in legs:
        seen = sorted((r.get("conversation_params") or {}).get("conversation_id", "-") for r in role)
        assert seen == ["-", "body-id", "conv-7"], seen
