#!/usr/bin/env python
"""A coordinator SIGKILLed under load: requests failed, and how long until it is back.

Launches a deployment on the simulator (`shmdisagg launch`'s `Deployment`: 2 context executors
behind a kv_cache_aware router that routes on their KV events only, 1 generation executor, 2
fleet workers), drives it with `--concurrency` clients (completions, streaming and not, prompts
sharing a few prefixes, every 8th a new one) and SIGKILLs the coordinator `--kills` times, `--gap` seconds apart. For
each kill it reports, measured from the kill:

- `restart_s`: until the new coordinator's line in the control table says RUNNING;
- `events_s`: until the KV index applies an event again (`events_applied` grows): drains resumed;
- the requests that failed while it was down, and the latency (p50 / p99 ms) of the requests
  that started in the `--gap` window after the kill against those of the window before it.

    .venv/bin/python benchmarks/bench_coordinator_restart.py [--kills 5] [--gap 6] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.benchkit import count, positive_float
from shmdisagg.config import load_config
from shmdisagg.launch import Deployment
from shmdisagg.shm.layout import COORD_RUNNING
from shmdisagg.shm.table import ControlTable

MODEL = "sim-llama-3.1-8b"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_config(tmp: Path) -> Path:
    cfg = {
        "hostname": "127.0.0.1",
        "port": free_port(),
        "num_workers": 2,
        "context_servers": {
            "num_instances": 2,
            "urls": [f"127.0.0.1:{free_port()}" for _ in range(2)],
            "router": {"type": "kv_cache_aware", "track_routed_blocks": False},
        },
        "generation_servers": {
            "num_instances": 1,
            "urls": [f"127.0.0.1:{free_port()}"],
            "router": {"type": "round_robin"},
        },
        "shmdisagg": {
            "shm": {"prefix": f"shmdisagg-bench-{os.getpid()}"},
            "coordinator_socket": str(tmp / "coord.sock"),
            "executors": {"backend": "sim", "model": MODEL, "sim": {"speedup": 20.0}},
        },
    }
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


class Load:
    """`(start time, latency s, ok)` of every request, from `concurrency` client loops."""

    def __init__(self, url: str, concurrency: int) -> None:
        self.url = url
        self.concurrency = concurrency
        self.done: list[tuple[float, float, bool]] = []
        self.stop = False

    async def _one(self, session: aiohttp.ClientSession, n: int) -> None:
        stream = n % 2 == 0
        # most prompts share one of five prefixes; every 8th is new, so KV events keep coming
        base = 1000 * (n % 5) if n % 8 else 5000 + n * 7 % 90000
        body = {"model": MODEL, "prompt": list(range(base, base + 200 + n % 7)), "max_tokens": 4, "stream": stream}
        start = time.monotonic()
        try:
            async with session.post(f"{self.url}/v1/completions", json=body) as r:
                raw = await r.read()
            ok = r.status == 200 and b'"error"' not in raw and (not stream or raw.rstrip().endswith(b"[DONE]"))
        except (TimeoutError, aiohttp.ClientError):
            ok = False
        self.done.append((start, time.monotonic() - start, ok))

    async def run(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:

            async def loop(i: int) -> None:
                n = i
                while not self.stop:
                    await self._one(session, n)
                    n += self.concurrency

            await asyncio.gather(*(loop(i) for i in range(self.concurrency)))


def _ms(latencies: list[float]) -> str:
    if len(latencies) < 2:
        return "-"
    q = statistics.quantiles(latencies, n=100)
    return f"{q[49] * 1e3:.1f} / {q[98] * 1e3:.1f}"


async def measure(dep: Deployment, kills: int, gap: float, concurrency: int) -> list[dict[str, object]]:
    load = Load(dep.url, concurrency)
    task = asyncio.ensure_future(load.run())
    rows = []
    with ControlTable.attach(dep.config.shm_prefix, read_only=True) as table:
        await asyncio.sleep(gap)
        for _ in range(kills):
            old = table.coordinator()
            applied = table.index_metrics()["events_applied"]
            t0 = time.monotonic()
            os.kill(old["pid"], signal.SIGKILL)
            restart = events = None
            while time.monotonic() - t0 < 60 and (restart is None or events is None):
                now = time.monotonic() - t0
                coord = table.coordinator()
                if restart is None and coord["pid"] != old["pid"] and coord["state"] == COORD_RUNNING:
                    restart = now
                if events is None and restart is not None and table.index_metrics()["events_applied"] > applied:
                    events = now
                await asyncio.sleep(0.005)
            await asyncio.sleep(max(0.0, gap - (time.monotonic() - t0)))
            before = [lat for s, lat, ok in load.done if t0 - gap <= s < t0]
            after = [(lat, ok) for s, lat, ok in load.done if t0 <= s < t0 + gap]
            rows.append(
                {
                    "restart_s": restart,
                    "events_s": events,
                    "requests": len(after),
                    "failed": sum(not ok for _, ok in after),
                    "before_ms": _ms(before),
                    "after_ms": _ms([lat for lat, _ in after]),
                }
            )
    load.stop = True
    await task
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=count, default=5)
    parser.add_argument(
        "--gap", type=positive_float, default=6.0, help="seconds between kills (and the window compared)"
    )
    parser.add_argument("--concurrency", type=count, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = write_config(Path(tmp))
        dep = Deployment(load_config(cfg), str(cfg), str(Path(tmp) / "logs"), background=True)
        dep.start()
        try:
            rows = asyncio.run(measure(dep, args.kills, args.gap, args.concurrency))
        finally:
            dep.stop()
    print(
        f"coordinator SIGKILL under load: {args.concurrency} clients, {args.kills} kills {args.gap:g} s apart, 2 "
        "fleet workers"
    )
    print(
        f"{'kill':>4} {'restart s':>9} {'events s':>9} {'requests':>8} {'failed':>6} {'p50/p99 ms before':>18} "
        f"{'p50/p99 ms after':>17}"
    )
    for i, r in enumerate(rows, 1):
        restart = f"{r['restart_s']:.2f}" if r["restart_s"] is not None else "never"
        events = f"{r['events_s']:.2f}" if r["events_s"] is not None else "never"
        print(
            f"{i:>4} {restart:>9} {events:>9} {r['requests']:>8} {r['failed']:>6} {r['before_ms']:>18} "
            f"{r['after_ms']:>17}"
        )
    failed = sum(int(r["failed"]) for r in rows)  # type: ignore[call-overload]
    print(f"failed requests: {failed} of {sum(int(r['requests']) for r in rows)}")  # type: ignore[call-overload]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
