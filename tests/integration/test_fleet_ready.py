"""A deployment is ready only when its whole fleet listens: every fleet worker's socket on the
public port takes connections when `shmdisagg launch` (or `serve`) reports ready, so a worker
that dies at once leaves the others to take the next connections (the chaos suite once saw
connections refused when the only worker listening was SIGKILLed 0.1 s after the start)."""

from __future__ import annotations

import http.client
import os
import select
import signal
from pathlib import Path

from shmdisagg.config import load_config
from shmdisagg.launch import Deployment
from tests.integration.harness import fake_executors, request_json, write_config

WORKERS = 3


def listening_sockets(port: int) -> int:
    """Sockets in LISTEN on `port` (any address), from the kernel's table: one per fleet worker,
    each with its own SO_REUSEPORT accept queue."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        with open(table) as f:
            next(f)
            for line in f:
                local, state = line.split()[1], line.split()[3]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                    count += 1
    return count


def test_every_fleet_worker_listens_when_the_deployment_is_ready_and_one_that_dies_at_once_refuses_nothing(
    tmp_path: Path, shm_prefix: str
) -> None:
    with fake_executors(["ctx", "gen"]) as (ctx, gen):
        path = write_config(tmp_path, shm_prefix, [ctx.addr], [gen.addr], num_workers=WORKERS)
        dep = Deployment(load_config(path), str(path), str(tmp_path / "logs"))
        dep.start()  # returns when the deployment is ready
        try:
            port = dep.config.port
            assert listening_sockets(port) == WORKERS
            status, info = request_json("127.0.0.1", port, "GET", "/cluster_info")
            assert status == 200 and len(info["fleet_pids"]) == WORKERS
            pidfd = os.pidfd_open(info["fleet_pids"][0])
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            # readable once it exited, its sockets closed (connections already in its queue are
            # lost with it: those are the chaos suite's "cut by a kill", not this test's)
            assert select.select([pidfd], [], [], 10)[0] == [pidfd]
            os.close(pidfd)
            for _ in range(20):  # new connections: the kernel spreads them over the live listeners
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
                c.request("GET", "/health")
                assert c.getresponse().status == 200
                c.close()
        finally:
            dep.stop()
