"""A deployment is ready only when its whole fleet listens: every fleet worker's socket on the
public port takes connections when `shmdisagg launch` (or `serve`) reports ready, so a worker
that dies at once leaves the others to take the next connections (the chaos suite once saw
connections refused when the only worker listening was SIGKILLed 0.1 s after the start)."""

from __future__ import annotations

import http.client
import os
import select
import signal
import time
from pathlib import Path

import pytest

from shmdisagg.config import load_config
from shmdisagg.launch import Deployment, LaunchError
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


def test_a_config_error_every_worker_finds_at_start_fails_the_start_at_once(
    tmp_path: Path, shm_prefix: str, capfd: pytest.CaptureFixture[str]
) -> None:
    """A tokenizing router with no tokenizer for real executors is refused by `launch`/`serve`
    before anything starts; a deployment started without that check (the Python API) used to
    restart its fleet for `server_start_timeout_s`, then call itself ready with no worker. Now
    the first worker's config error stops the start, naming it."""
    with fake_executors(["ctx", "gen"]) as (ctx, gen):
        path = write_config(
            tmp_path,
            shm_prefix,
            [ctx.addr],
            [gen.addr],
            num_workers=2,
            routers=("kv_cache_aware", "round_robin"),
            shmdisagg={"server_start_timeout_s": 60},
        )
        dep = Deployment(load_config(path), str(path), str(tmp_path / "logs"))
        t0 = time.monotonic()
        with pytest.raises(LaunchError) as err:
            dep.start()
        dep.stop()
        assert time.monotonic() - t0 < 30  # well before server_start_timeout_s, and not restarted
        assert "during start-up" in str(err.value), err.value
        lines = capfd.readouterr().err
        assert "config error: context_servers.router.tokenizer_dir" in lines  # the worker's one line
        assert lines.count("coordinator failed to start: fleet worker(s)") == 1, lines
        assert not list(Path("/dev/shm").glob(f"{shm_prefix}*"))  # nothing left behind
