#!/usr/bin/env python
"""A request's deadline on uvloop: its own `call_later` and cancel, against an entry in the
worker's `OpenRequests` (orchestrator/deadlines.py), side by side in one process.

Each step is one loop iteration (`await asyncio.sleep(0)`), so uvloop's close callbacks of the
cancelled timers run as they do in a worker; the bare iteration is timed too and subtracted.
Rounds alternate the three ways; the table shows each way's best round.

    .venv/bin/python benchmarks/bench_timers.py [--n 2000] [--rounds 30]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable
from pathlib import Path

import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.benchkit import count
from shmdisagg.orchestrator.deadlines import OpenRequests


async def per_step(n: int, step: Callable[[], None]) -> float:
    """µs per step, one loop iteration each."""
    t0 = time.perf_counter()
    for _ in range(n):
        step()
        await asyncio.sleep(0)
    return (time.perf_counter() - t0) / n * 1e6


async def main(n: int, rounds: int) -> None:
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    reqs: OpenRequests[None] = OpenRequests(180.0, lambda task, item: None)

    def nothing() -> None:
        pass

    def own_timer() -> None:
        loop.call_later(180.0, nothing).cancel()

    def open_requests() -> None:
        reqs.open(task, None)
        reqs.close(task)

    ways = {"bare iteration": nothing, "call_later + cancel": own_timer, "OpenRequests open + close": open_requests}
    best = dict.fromkeys(ways, float("inf"))
    for _ in range(rounds):
        for name, step in ways.items():
            best[name] = min(best[name], await per_step(n, step))
    bare = best["bare iteration"]
    print(f"uvloop, best of {rounds} rounds of {n} steps, one loop iteration a step")
    print()
    print("| way | µs a step | µs over a bare iteration |")
    print("|---|---|---|")
    for name, us in best.items():
        print(f"| {name} | {us:.3f} | {us - bare:.3f} |")
    timer, entry = best["call_later + cancel"] - bare, best["OpenRequests open + close"] - bare
    print()
    print(f"own timer / OpenRequests entry: {timer / max(entry, 1e-3):.1f}x")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=count, default=2000)
    ap.add_argument("--rounds", type=count, default=30)
    args = ap.parse_args()
    uvloop.run(main(args.n, args.rounds))
