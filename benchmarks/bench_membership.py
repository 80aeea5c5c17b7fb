#!/usr/bin/env python3
"""How fast executors join and leave a running deployment through etcd (`disagg_cluster`).

Usage: .venv/bin/python benchmarks/bench_membership.py [--rounds 20]

Starts an etcd (Debian's `etcd-server`, on free loopback ports, a temporary data directory), a
deployment watching it (`shmdisagg serve`'s coordinator and a fleet of 1, through the launcher),
and two simulators that do not register themselves. Then, `--rounds` times: put a worker key for
one simulator on a lease (as `trtllm-serve --disagg_cluster_uri` registers) and time until the
shared table shows that server present and healthy (prepared: `/health`, `/server_info`,
`/v1/models` read); delete the key (a clean deregistration) and time until the table no longer
has it. The table is read from this process (a read-only attach, polled every 0.5 ms), so the
times are the coordinator's: etcd's watch event, the membership change, the health probe.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import yaml

from benchmarks.benchkit import count
from shmdisagg.cluster.workers import WorkerInfo, new_worker_id, worker_key
from shmdisagg.config import load_config
from shmdisagg.launch import Deployment, http_status
from shmdisagg.shm.table import ControlTable
from tests.conftest import free_port
from tests.integration.etcd import EtcdServer


def until(pred, start: float | None = None, timeout_s: float = 30.0) -> float:  # type: ignore[no-untyped-def]
    """ms from `start` (perf_counter; default now) until `pred()`."""
    start = time.perf_counter() if start is None else start
    while not pred():
        if time.perf_counter() - start > timeout_s:
            raise TimeoutError("condition not reached")
        time.sleep(0.0005)
    return (time.perf_counter() - start) * 1000.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=count, default=20)
    args = ap.parse_args()
    import aetcd

    tmp = Path(tempfile.mkdtemp(prefix="bench-membership-"))
    etcd = EtcdServer(tmp / "etcd")
    etcd.start()
    name, prefix = f"b{uuid.uuid4().hex[:6]}", f"shmdisagg-bm{uuid.uuid4().hex[:6]}"
    ports = [free_port(), free_port()]
    sims = [
        subprocess.Popen(
            [sys.executable, "-m", "shmdisagg.executors.sim", "--host", "127.0.0.1", "--port", str(p), "--role", role]
        )  # fmt: skip
        for p, role in zip(ports, ("context", "generation"), strict=True)
    ]
    cfg = {
        "hostname": "127.0.0.1",
        "port": free_port(),
        "num_workers": 1,
        "disagg_cluster": {"cluster_uri": etcd.uri, "cluster_name": name},
        "context_servers": {"router": {"type": "round_robin"}},
        "generation_servers": {"router": {"type": "round_robin"}},
        "shmdisagg": {"shm": {"prefix": prefix}, "coordinator_socket": str(tmp / "c.sock"),
                      "health_check_interval_s": 0.5},
    }  # fmt: skip
    (tmp / "c.yaml").write_text(yaml.safe_dump(cfg))
    dep = Deployment(load_config(tmp / "c.yaml"), str(tmp / "c.yaml"), str(tmp / "logs"))
    joins: list[float] = []
    leaves: list[float] = []
    try:
        for p in ports:
            until(lambda p=p: http_status(f"http://127.0.0.1:{p}/health") == 200)
        dep.start()
        table = ControlTable.attach(prefix, read_only=True)

        def present(port: int, healthy: bool) -> bool:
            return any(s.addr.endswith(f":{port}") and (s.healthy or not healthy) for s in table.servers())

        async def rounds() -> None:
            client = aetcd.Client(host="127.0.0.1", port=etcd.port)
            try:
                for r in range(args.rounds):
                    port, role = ports[r % 2], r % 2
                    info = WorkerInfo(new_worker_id(role, "127.0.0.1", port), "127.0.0.1", port, role)
                    key = worker_key(name, info.worker_id).encode()
                    lease = await client.lease(10)
                    t0 = time.perf_counter()  # the clock starts before the put is sent
                    await client.put(key, info.encode().encode(), lease=lease)
                    joins.append(await asyncio.to_thread(until, lambda port=port: present(port, True), t0))
                    t0 = time.perf_counter()
                    await client.delete(key)
                    leaves.append(await asyncio.to_thread(until, lambda port=port: not present(port, False), t0))
                    await lease.revoke()
            finally:
                await client.close()

        asyncio.run(rounds())
        table.close()
    finally:
        dep.stop()
        for s in sims:
            s.terminate()
            s.wait()
        etcd.stop()

    def row(what: str, v: list[float]) -> str:
        q = statistics.quantiles(v, n=10)
        return f"{what:58} {statistics.median(v):8.1f} {q[8]:8.1f} {min(v):8.1f} {max(v):8.1f}"

    print(f"{'ms, ' + str(args.rounds) + ' rounds':58} {'p50':>8} {'p90':>8} {'min':>8} {'max':>8}")
    print(row("join: key put -> present and healthy in the table", joins))
    print(row("leave: key deleted -> gone from the table", leaves))


if __name__ == "__main__":
    main()
