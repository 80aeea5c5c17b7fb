"""A fleet worker that is alive but stuck (here SIGSTOPped) is killed and replaced once its row's
heartbeat is older than `worker_timeout_s`: its share of the port's connections stops going
into a process that never answers."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import aiohttp

from shmdisagg.coordinator.supervisor import FleetSupervisor
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


def _fleet(dep) -> dict:  # type: ignore[no-untyped-def,type-arg]
    """The coordinator's own /cluster_info (its Unix socket: no fleet worker in the way)."""

    async def get() -> dict:  # type: ignore[type-arg]
        async with aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=dep.config.coordinator_socket)
        ) as session:
            async with session.get("http://coordinator/cluster_info") as r:
                return await r.json()  # type: ignore[no-any-return]

    return asyncio.run(get())


def test_a_stuck_worker_is_killed_and_replaced(tmp_path: Path, shm_prefix: str) -> None:
    with fake_executors(["c0", "g0"]) as (ctx, gen):
        cfg = write_config(tmp_path, shm_prefix, [ctx.addr], [gen.addr], shmdisagg={"worker_timeout_s": 2.0})
        with deployment(cfg) as dep:
            conn = connection_to_worker(dep, 0)
            stuck = request_json("", 0, "GET", "/cluster_info", conn=conn)[1]["worker_pid"]
            conn.close()
            os.kill(stuck, signal.SIGSTOP)
            try:

                def replaced() -> bool:
                    info = _fleet(dep)
                    return (
                        info["fleet_stuck_kills"] == 1
                        and stuck not in info["fleet_pids"]
                        and len(info["fleet_pids"]) == 2
                    )

                wait_until(replaced, timeout_s=30, what="the stuck worker replaced")
            finally:
                try:
                    os.kill(stuck, signal.SIGCONT)  # only if the test failed before the kill
                except ProcessLookupError:
                    pass
            # every connection is answered again, by the replacement or the other worker
            assert all(post(dep, "/v1/completions", COMPLETION)[0] == 200 for _ in range(8))


def test_a_stale_heartbeat_or_a_row_never_claimed_counts_once_and_timeout_0_turns_it_off() -> None:
    class Table:
        def __init__(self, beats: dict[int, int]) -> None:
            self.beats = beats

        def rows(self) -> list:  # type: ignore[type-arg]
            from shmdisagg.shm.table import RowInfo

            return [RowInfo(i, pid, 1, 0, hb, 0, 0) for i, (pid, hb) in enumerate(self.beats.items())]

    class Proc:
        def __init__(self, pid: int) -> None:
            self.pid, self.killed = pid, False

        def kill(self) -> None:
            self.killed = True

    from shmdisagg.coordinator.supervisor import WorkerProc

    sup = FleetSupervisor(Table({101: 0, 102: 9_500_000_000}), "cfg.yaml", 4, worker_timeout_s=2.0)  # type: ignore[arg-type]
    procs = {i: Proc(pid) for i, pid in enumerate((101, 102, 103, 104))}  # 103, 104: no row claimed
    started = {0: 0.0, 1: 0.0, 2: 9.0, 3: 1.0}  # monotonic seconds when started or promoted
    sup.workers = {i: WorkerProc(i, p, -1, started[i]) for i, p in procs.items()}  # type: ignore[arg-type]
    # at 10 s: 101's beat is 10 s old (killed), 102's 0.5 s; 103 (started 1 s ago) and 104 (9 s
    # ago) have no row yet but are within the claim grace: still importing on a loaded machine
    assert sup.kill_stuck(10 * 10**9) == [0]
    assert [p.killed for p in procs.values()] == [True, False, False, False] and sup.stuck_kills == 1
    # at 17 s: 102's beat is 7.5 s old; 104 started 16 s ago and still has no row (a standby
    # stopped before its promotion never claims one): both killed; 103 (8 s) is still starting
    assert sup.kill_stuck(17 * 10**9) == [1, 3]
    assert [p.killed for p in procs.values()] == [True, True, False, True] and sup.stuck_kills == 3
    assert sup.kill_stuck(18 * 10**9) == [] and sup.stuck_kills == 3  # killed once: their exits are on their way
    sup._stopping = True  # a worker finishing its graceful stop is not judged
    assert sup.kill_stuck(20 * 10**9) == []
    off = FleetSupervisor(Table({}), "cfg.yaml", 1, worker_timeout_s=0.0)  # type: ignore[arg-type]
    asyncio.run(asyncio.wait_for(off.watch(), 1.0))  # returns at once: nothing is watched
