"""Routing decisions are global across fleet workers: what one worker does, the next one sees."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

from shmdisagg.launch import http_status
from shmdisagg.shm.table import ROLE_GENERATION, ControlTable
from tests.conftest import free_port
from tests.integration.harness import (
    REPO,
    connection_to_worker,
    deployment,
    fake_executors,
    post,
    stream_lines,
    wait_until,
    write_config,
)

COMPLETION = {"model": "fake-model", "prompt": "hello", "max_tokens": 4}


def _server_of(resp: dict) -> str:
    return resp["id"].removeprefix("cmpl-")  # the fake generation executor names itself in the id


def test_round_robin_over_two_workers_cycles_all_servers_globally(tmp_path: Path, shm_prefix: str) -> None:
    with fake_executors(["c0", "g0", "g1", "g2"]) as (ctx, *gens):
        cfg = write_config(tmp_path, shm_prefix, [ctx.addr], [g.addr for g in gens])
        with deployment(cfg) as dep:
            conns = [connection_to_worker(dep, 0), connection_to_worker(dep, 1)]
            order = []
            for i in range(12):
                status, resp = post(dep, "/v1/completions", COMPLETION, conn=conns[i % 2])
                assert status == 200
                order.append(_server_of(resp))
            # One ticket counter for the fleet: any three consecutive requests, whichever worker
            # took them, went to three different servers. Per-worker counters would give g0, g0, g1, g1, ...
            assert all(len(set(order[i : i + 3])) == 3 for i in range(len(order) - 2)), order
            for c in conns:
                c.close()


def test_load_balancing_sees_load_added_by_another_worker(tmp_path: Path, shm_prefix: str) -> None:
    with fake_executors(["c0", "g0", "g1"]) as (ctx, g0, g1):
        cfg = write_config(
            tmp_path, shm_prefix, [ctx.addr], [g0.addr, g1.addr], routers=("round_robin", "load_balancing")
        )
        with deployment(cfg) as dep:
            for g in (g0, g1):
                g.script(hold=True)
            c0 = connection_to_worker(dep, 0)
            c1 = connection_to_worker(dep, 1)
            held = threading.Thread(
                target=stream_lines, args=(dep, "/v1/completions", {**COMPLETION, "stream": True}, c0)
            )
            # A streamed request through worker 0 stays open on one generation server...
            held.start()
            busy_name = {}

            def one_is_busy() -> bool:
                with ControlTable.attach(dep.config.shm_prefix) as table:
                    busy = [s for s in table.servers() if s.role == ROLE_GENERATION and table.load(s.slot)[0] == 1]
                if len(busy) == 1:
                    busy_name["addr"] = busy[0].addr
                return len(busy) == 1

            wait_until(one_is_busy, what="the held stream's load in the table")
            busy = g0 if busy_name["addr"] == g0.addr else g1
            idle = g1 if busy is g0 else g0
            for g in (g0, g1):
                g.script(hold=False)
            # ...so every request through worker 1 goes to the other one.
            for _ in range(4):
                status, resp = post(dep, "/v1/completions", COMPLETION, conn=c1)
                assert status == 200 and _server_of(resp) == idle.name
            busy.release()
            held.join(timeout=30)
            assert not held.is_alive()
            with ControlTable.attach(dep.config.shm_prefix) as table:
                assert all(table.load(s.slot) == (0, 0) for s in table.servers())
            c0.close()
            c1.close()


def test_a_deployment_of_70_executors_routes_to_every_one_past_slot_64(tmp_path: Path, shm_prefix: str) -> None:
    """70 listed executors: the table is sized to 128 slots, and the fleet's global round robin
    sends a context leg to every context executor, the ones in slots 64..68 too."""
    ports: list[int] = []
    while len(ports) < 69:
        if (port := free_port()) not in ports:
            ports.append(port)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.fakes.multiport", "--ports", ",".join(map(str, ports)), "--name", "c"],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
    )
    try:
        with fake_executors(["g0"]) as (gen,):
            for port in ports:
                wait_until(lambda port=port: http_status(f"http://127.0.0.1:{port}/health") == 200, what=f"{port}")
            ctx = [f"127.0.0.1:{p}" for p in ports]
            cfg = write_config(tmp_path, shm_prefix, ctx, [gen.addr], shmdisagg={"health_check_interval_s": 1.0})
            with deployment(cfg) as dep:
                assert dep.config.max_servers == 128
                conns = [connection_to_worker(dep, 0), connection_to_worker(dep, 1)]
                for i in range(2 * len(ctx)):
                    status, _ = post(dep, "/v1/completions", COMPLETION, conn=conns[i % 2])
                    assert status == 200
                for c in conns:
                    c.close()
                with ControlTable.attach(dep.config.shm_prefix) as table:
                    assert table.max_servers == 128
                    by_addr = {s.addr: s.slot for s in table.servers()}
                    assert [by_addr[a] for a in ctx] == list(range(69)) and by_addr[gen.addr] == 69
                    assert [table.routed(slot) for slot in range(69)] == [2] * 69
                    assert table.routed(69) == 2 * len(ctx)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
