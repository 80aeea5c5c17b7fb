"""Executor health as the client sees it: a busy server whose `/health` is slow keeps serving,
and requests that come after every server of a role died, before any health poll could notice,
get that role's 503 with an OpenAI error body naming no executor."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from shmdisagg.shm.table import ControlTable
from tests.integration.harness import deployment, fake_executors, post, wait_until, write_config

COMPLETION = {"model": "fake-model", "prompt": "hello", "max_tokens": 4}


def _healthy(dep, addr: str) -> bool:  # type: ignore[no-untyped-def]
    with ControlTable.attach(dep.config.shm_prefix) as table:
        return any(s.addr == addr and s.healthy for s in table.servers())


def test_a_server_answering_requests_is_not_taken_out_for_a_slow_health_check(tmp_path: Path, shm_prefix: str) -> None:
    with fake_executors(["c0", "g0"]) as (ctx, gen):
        sd = {"health_check_interval_s": 0.2, "health_check_timeout_s": 0.3, "health_check_failures": 2}
        cfg = write_config(tmp_path, shm_prefix, [ctx.addr], [gen.addr], shmdisagg=sd)
        with deployment(cfg) as dep:
            gen.script(health_delay_s=2.0)  # every probe of it times out from here
            # about six probe periods (0.5 s each): two failed probes in a row took it out before
            until = time.monotonic() + 3.0
            served = 0
            while time.monotonic() < until:
                status, body = post(dep, "/v1/completions", COMPLETION)
                assert status == 200, body
                assert _healthy(dep, gen.addr)
                served += 1
            assert served >= 10
            # no request, no answered leg: its failed probes alone take it out now
            wait_until(
                lambda: not _healthy(dep, gen.addr),
                timeout_s=5,
                what="the idle server with a slow /health marked unhealthy",
            )
            gen.script(health_delay_s=0.0)
            wait_until(lambda: _healthy(dep, gen.addr), timeout_s=5, what="re-admission once /health answers in time")


def _send_all(dep, bodies: list[dict[str, Any]]) -> list[tuple[int, bytes]]:  # type: ignore[no-untyped-def]
    """POST every body at once; (status, raw body) of each."""
    import http.client

    out: list[tuple[int, bytes]] = [(0, b"")] * len(bodies)

    def one(i: int) -> None:
        c = http.client.HTTPConnection("127.0.0.1", dep.config.port, timeout=30)
        try:
            c.request(
                "POST", "/v1/completions", body=orjson.dumps(bodies[i]), headers={"content-type": "application/json"}
            )
            r = c.getresponse()
            out[i] = (r.status, r.read())
        finally:
            c.close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return out


@pytest.mark.parametrize("role", ["context", "generation"])
def test_requests_right_after_every_server_of_a_role_died_get_the_roles_503(
    tmp_path: Path, shm_prefix: str, role: str
) -> None:
    with fake_executors(["c0", "c1", "g0", "g1"]) as (c0, c1, g0, g1):
        # the first poll admits them; the next one would come in 10 minutes
        cfg = write_config(
            tmp_path, shm_prefix, [c0.addr, c1.addr], [g0.addr, g1.addr], shmdisagg={"health_check_interval_s": 600}
        )
        with deployment(cfg) as dep:
            for _ in range(4):  # both servers of each role used: keep-alive connections to them
                assert post(dep, "/v1/completions", COMPLETION)[0] == 200
            before = len(g0.recorded()) + len(g1.recorded())
            victims = (c0, c1) if role == "context" else (g0, g1)
            for v in victims:
                v.proc.kill()  # SIGKILL
            for v in victims:
                v.proc.wait()
            bodies = [{**COMPLETION, "stream": s} for s in (False, True, False, True, False, True)]
            results = _send_all(dep, bodies)
            addrs = [f"127.0.0.1:{f.port}" for f in (c0, c1, g0, g1)]
            for (status, raw), body in zip(results, bodies, strict=True):
                assert status == 503, (body, raw)
                err = orjson.loads(raw)  # nothing was sent yet: a JSON body, streaming or not
                assert err["object"] == "error" and err["code"] == 503 and err["type"] == "ServiceUnavailableError"
                assert f"no healthy {role} server" in err["message"]
                text = raw.decode()
                assert "127.0.0.1" not in text and not any(str(f.port) in text for f in (c0, c1, g0, g1)), text
                assert not any(a in text for a in addrs)
            if role == "context":  # no generation leg without a context answer
                assert len(g0.recorded()) + len(g1.recorded()) == before
