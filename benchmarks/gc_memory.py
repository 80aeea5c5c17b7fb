"""Resident memory of the coordinator and its fleet worker over many requests, with the cyclic
garbage collector off (TRTLLM_DISAGG_SERVER_DISABLE_GC unset or 1, TensorRT-LLM's default) and on
(0): does anything on our request paths (answers, 400s, 404s) leave reference cycles that only
the collector would free?

    .venv/bin/python benchmarks/gc_memory.py N VALUE...     e.g. benchmarks/gc_memory.py 3000 1 0

For each VALUE: two simulators and `shmdisagg serve` (one fleet worker) with
TRTLLM_DISAGG_SERVER_DISABLE_GC=VALUE, 300 warm-up requests, then N on one keep-alive
connection (in every 5: three answered completions, a 400 for n=3, a 404 for an unknown model);
prints both processes' VmRSS before and after the N.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import orjson
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.benchkit import count  # noqa: E402
from shmdisagg.executors.sim.testing import SimProcess  # noqa: E402
from tests.conftest import free_port  # noqa: E402

BODIES = [
    {"model": "m", "prompt": "hello world " * 20, "max_tokens": 4},
    {"model": "m", "prompt": "hello world " * 20, "max_tokens": 4},
    {"model": "m", "prompt": "hello world " * 20, "max_tokens": 4},
    {"model": "m", "prompt": "x", "n": 3},  # 400
    {"model": "nope", "prompt": "x"},  # 404
]


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


def call(conn: http.client.HTTPConnection, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
    data = orjson.dumps(body) if body is not None else None
    conn.request(method, path, body=data, headers={"content-type": "application/json"} if data else {})
    r = conn.getresponse()
    return r.status, r.read()


def run(value: str, n: int) -> str:
    tmp = tempfile.mkdtemp(prefix=f"gc-memory-{value}-")
    ports = free_port(), free_port()
    sims = [
        SimProcess(["--port", str(p), "--role", role, "--speedup", "1000", "--model", "m"], p)
        for p, role in zip(ports, ("context", "generation"), strict=True)
    ]
    for s in sims:
        s.start()
    port = free_port()
    cfg = {
        "hostname": "127.0.0.1",
        "port": port,
        "num_workers": 1,
        "context_servers": {"urls": [f"127.0.0.1:{ports[0]}"]},
        "generation_servers": {"urls": [f"127.0.0.1:{ports[1]}"]},
        "shmdisagg": {"shm": {"prefix": f"gcm{os.getpid()}-{value}"}, "coordinator_socket": f"{tmp}/c.sock"},
    }
    with open(f"{tmp}/cfg.yaml", "w") as f:
        yaml.safe_dump(cfg, f)
    env = dict(os.environ, TRTLLM_DISAGG_SERVER_DISABLE_GC=value)
    with open(f"{tmp}/serve.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "shmdisagg.cli", "serve", "-c", f"{tmp}/cfg.yaml", "-l", "warning"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=log,
            cwd=REPO,
        )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if call(http.client.HTTPConnection("127.0.0.1", port, timeout=5), "GET", "/health")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"the deployment did not start; see {tmp}/serve.log")
            time.sleep(0.2)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        worker = json.loads(call(conn, "GET", "/cluster_info")[1])["worker_pid"]
        for i in range(300):
            call(conn, "POST", "/v1/completions", BODIES[i % len(BODIES)])
        before = rss_kb(worker), rss_kb(proc.pid)
        started = time.monotonic()
        for i in range(n):
            call(conn, "POST", "/v1/completions", BODIES[i % len(BODIES)])
        took = time.monotonic() - started
        after = rss_kb(worker), rss_kb(proc.pid)
        return (
            f"TRTLLM_DISAGG_SERVER_DISABLE_GC={value}: {n} requests in {took:.0f} s; fleet worker VmRSS "
            f"{before[0]} -> {after[0]} kB "
            f"(+{after[0] - before[0]}), coordinator {before[1]} -> {after[1]} kB (+{after[1] - before[1]})"
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        for s in sims:
            s.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("n", type=count, help="measured requests for each value")
    ap.add_argument("value", nargs="+", help="TRTLLM_DISAGG_SERVER_DISABLE_GC values to run, in turn")
    args = ap.parse_args()
    for value in args.value:
        print(run(value, args.n), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
