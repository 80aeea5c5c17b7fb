"""Kill -9 a fleet worker under load: a replacement serves quickly and no load leaks."""

from __future__ import annotations

import http.client
import os
import signal
import threading
import time
from pathlib import Path

import orjson

from shmdisagg.shm.table import ControlTable
from tests.integration.harness import (
    connection_to_worker,
    deployment,
    fake_executors,
    post,
    request_json,
    wait_until,
    write_config,
)

COMPLETION = {"model": "fake-model", "prompt": "hello", "max_tokens": 4}


def _load_loop(port: int, stop: threading.Event, results: list[int]) -> None:
    """Sequential requests on fresh connections (spread over workers by SO_REUSEPORT)."""
    deadline = time.monotonic() + 60
    while not stop.is_set() and time.monotonic() < deadline:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            stream = len(results) % 2 == 0
            c.request(
                "POST",
                "/v1/completions",
                body=orjson.dumps({**COMPLETION, "stream": stream}),
                headers={"content-type": "application/json"},
            )
            r = c.getresponse()
            r.read()
            results.append(r.status)
        except (OSError, http.client.HTTPException):
            results.append(-1)  # in flight on the killed worker
        finally:
            c.close()


def test_killed_worker_is_replaced_within_2s_and_its_load_is_reclaimed_exactly(tmp_path: Path, shm_prefix: str) -> None:
    with fake_executors(["c0", "g0", "g1"]) as (ctx, g0, g1):
        for g in (g0, g1):
            g.script(delay_s=0.05)  # keep requests in flight on every worker
        cfg = write_config(
            tmp_path,
            shm_prefix,
            [ctx.addr],
            [g0.addr, g1.addr],
            routers=("load_balancing", {"type": "load_balancing", "use_tokens": True}),
        )
        with deployment(cfg) as dep:
            conn = connection_to_worker(dep, 0)
            old_pid = request_json("", 0, "GET", "/cluster_info", conn=conn)[1]["worker_pid"]
            conn.close()
            stop = threading.Event()
            results: list[int] = []
            threads = [threading.Thread(target=_load_loop, args=(dep.config.port, stop, results)) for _ in range(6)]
            for t in threads:
                t.start()
            wait_until(lambda: len(results) >= 30, what="load to flow")

            os.kill(old_pid, signal.SIGKILL)
            killed_at = time.monotonic()

            def replacement_serves() -> bool:
                try:
                    c = connection_to_worker(dep, 0, attempts=20)
                except (AssertionError, OSError, http.client.HTTPException):
                    return False
                try:
                    info = request_json("", 0, "GET", "/cluster_info", conn=c)[1]
                    return info["worker_pid"] != old_pid and post(dep, "/v1/completions", COMPLETION, conn=c)[0] == 200
                finally:
                    c.close()

            wait_until(replacement_serves, timeout_s=10, what="a replacement worker")
            replaced_in = time.monotonic() - killed_at
            n_after = len(results)
            wait_until(lambda: len(results) >= n_after + 20, what="load to continue")
            stop.set()
            for t in threads:
                t.join(timeout=60)
            print(f"replacement served after {replaced_in:.2f} s")
            assert replaced_in < 2.0, f"replacement took {replaced_in:.2f} s"
            assert results.count(200) >= 50
            with ControlTable.attach(dep.config.shm_prefix) as table:
                assert all(table.load(s.slot) == (0, 0) for s in table.servers())
                assert old_pid not in [r.pid for r in table.rows()]


def _standby_pids(coordinator_pid: int) -> list[int]:
    """The coordinator's children started as the warm standby (SHMDISAGG_WORKER_INDEX=standby)
    and not exited: their environment still reads so after a promotion, so the caller tells a
    promoted one by the table's rows."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:  # exited meanwhile, or not ours to read
            continue
        if int(fields[1]) == coordinator_pid and fields[0] != "Z" and b"SHMDISAGG_WORKER_INDEX=standby" in env:
            pids.append(int(entry))
    return pids


def test_a_standby_that_dies_is_reaped_and_replaced_and_the_next_death_still_promotes_one(
    tmp_path: Path, shm_prefix: str
) -> None:
    with fake_executors(["c0", "g0"]) as (ctx, gen):
        cfg = write_config(tmp_path, shm_prefix, [ctx.addr], [gen.addr], num_workers=1)
        with deployment(cfg) as dep:
            assert dep.coordinator is not None
            coordinator = dep.coordinator.proc.pid
            with ControlTable.attach(dep.config.shm_prefix) as table:
                seen: list[int] = []

                def standby_other_than(old: int) -> bool:
                    workers = {r.pid for r in table.rows()}
                    waiting = [p for p in _standby_pids(coordinator) if p not in workers and p != old]
                    seen[:] = waiting
                    return len(waiting) == 1

                wait_until(lambda: standby_other_than(0), what="the warm standby")
                first = seen[0]
                os.kill(first, signal.SIGKILL)
                wait_until(lambda: standby_other_than(first), what="a new standby")
                second = seen[0]
                wait_until(lambda: not os.path.exists(f"/proc/{first}"), what="the dead standby reaped")
                # the worker's death now promotes the new standby (warm), not a cold start
                conn = connection_to_worker(dep, 0)
                old = request_json("", 0, "GET", "/cluster_info", conn=conn)[1]["worker_pid"]
                conn.close()
                os.kill(old, signal.SIGKILL)
                wait_until(lambda: second in {r.pid for r in table.rows()}, what="the new standby promoted")

                def serves() -> bool:
                    try:
                        return post(dep, "/v1/completions", COMPLETION)[0] == 200
                    except OSError:  # before the promoted worker listens: refused
                        return False

                wait_until(serves, what="the promoted worker to serve")
