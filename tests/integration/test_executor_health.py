"""Executor health as the client sees it: a busy server whose `/health` is slow keeps serving."""

from __future__ import annotations

import time
from pathlib import Path

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
            wait_until(lambda: not _healthy(dep, gen.addr), timeout_s=5, what="the idle server with a slow /health marked unhealthy")
            gen.script(health_delay_s=0.0)
            wait_until(lambda: _healthy(dep, gen.addr), timeout_s=5, what="re-admission once /health answers in time")
