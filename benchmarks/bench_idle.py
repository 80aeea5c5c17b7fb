#!/usr/bin/env python
"""CPU of an idle deployment: each fleet worker and the coordinator, in ms of CPU per second.

What a deployment costs with no request in flight: heartbeats, health checks, KV event polls,
timers. For each `--tree` (a checkout with its `.venv`) and fleet size, one deployment in front
of the recording fakes (`bench_trees.fakes_running`, `bench_trees.deployment`), left
`--settle-s` seconds, then measured over `--seconds` (the run time of each process's threads,
schedstat). Trees take turns every round. `--executors 2,64`: also in front of 64 executors
(half of each role; two multi-port fakes, `tests/fakes/multiport.py`), where the coordinator's
health checks (one probe per executor every `health_check_interval_s`, 0.5 s here) dominate.

    .venv/bin/python benchmarks/bench_idle.py --tree . [--tree /tmp/base] [--fleet 1,4] [--executors 2,64] \
        [--seconds 20] [--rounds 2]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import benchkit  # noqa: E402
from benchmarks.bench_trees import deployment, fakes_running  # noqa: E402
from benchmarks.benchkit import count, cpu_ns, non_negative_float, positive_float  # noqa: E402

Urls = tuple[list[str], list[str]]


def cell(tree: Path, fakes: list[int], fleet: int, urls: Urls | None, args: argparse.Namespace) -> dict[str, float]:
    """ms of CPU per second: each fleet worker's (their median) and the coordinator's."""
    with deployment(tree, fakes, fleet, urls) as (base, pids):
        with urllib.request.urlopen(f"{base}/cluster_info") as r:
            coordinator = int(json.loads(r.read())["coordinator_pid"])
        time.sleep(args.settle_s)  # start-up work (imports, first health checks) out of the window
        procs = [*pids, coordinator]
        t0, c0 = time.monotonic(), [cpu_ns(p) for p in procs]
        time.sleep(args.seconds)  # the measurement itself: nothing is sent meanwhile
        wall = time.monotonic() - t0
        per_s = [(cpu_ns(p) - c) / 1e6 / wall for p, c in zip(procs, c0, strict=True)]
        return {"worker": statistics.median(per_s[:-1]), "coordinator": per_s[-1]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--tree",
        action="append",
        type=benchkit.checkout_with_venv,
        required=True,
        help="a checkout with its .venv (repeatable)",
    )
    ap.add_argument("--fleet", default="1,4", help="fleet sizes (num_workers)")
    ap.add_argument("--executors", default="2", help="executor counts (2: the recording fakes; more: multi-port fakes)")
    ap.add_argument("--seconds", type=positive_float, default=20.0)
    ap.add_argument("--settle-s", type=non_negative_float, default=3.0)
    ap.add_argument("--rounds", type=count, default=2)
    args = ap.parse_args()
    trees = [Path(t).resolve() for t in args.tree]
    fleets = benchkit.positive_ints(ap, "--fleet", args.fleet)
    counts = benchkit.positive_ints(ap, "--executors", args.executors)
    if any(n < 2 for n in counts):
        ap.error("--executors: at least 2 (one context and one generation executor)")
    for tree in trees:
        if not (tree / ".venv/bin/shmdisagg").exists():
            ap.error(f"--tree {tree}: no .venv/bin/shmdisagg there (CONTRIBUTING.md, 'compare two builds')")
    results: dict[tuple[str, int, int], list[dict[str, float]]] = {}
    with fakes_running() as fakes, contextlib.ExitStack() as stack:
        urls: dict[int, Urls | None] = {}
        for n in counts:
            if n == 2:
                urls[n] = None
                continue
            ex = benchkit.start_executors("multiport", n // 2, n - n // 2)
            stack.callback(ex.stop)
            urls[n] = (ex.ctx, ex.gen)
        for rnd in range(args.rounds):
            for n in counts:
                for fleet in fleets:
                    for tree in trees if rnd % 2 == 0 else reversed(trees):
                        row = cell(tree, fakes, fleet, urls[n], args)
                        results.setdefault((str(tree), fleet, n), []).append(row)
                        print(f"round {rnd} n{n} f{fleet} {tree}: {row}", flush=True)
    print(
        f"\n{time.strftime('%Y-%m-%d %H:%M')}, idle {args.seconds:g} s after {args.settle_s:g} s, "
        f"{args.rounds} rounds (median, min-max); load average {os.getloadavg()[0]:.1f}\n"
    )
    print("| executors | fleet | tree | a fleet worker, ms/s | the coordinator, ms/s |")
    print("|---|---|---|---|---|")
    for n in counts:
        for fleet in fleets:
            for tree in trees:
                rows = results[(str(tree), fleet, n)]
                cells = []
                for key in ("worker", "coordinator"):
                    v = [r[key] for r in rows]
                    cells.append(f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})")
                print(f"| {n} | {fleet} | {tree} | {' | '.join(cells)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
