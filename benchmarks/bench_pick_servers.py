#!/usr/bin/env python3
"""The cost of one pick as the number of executors grows (issue 15: a table that grows).

Usage: .venv/bin/python benchmarks/bench_pick_servers.py [--servers 4,64] [--reps 20000] [--rounds 5]

For each executor count N: a control table with N healthy context servers and 16 claimed worker
rows (every row carrying some load on every server, so the load sums are real), and a KV block
index of 2^20 slots holding 200k cached blocks spread over the servers plus 16 prompt families
(each 1k-token family prefix stored on one server). Timed, per call, from one worker's view:
`pick_round_robin`, `pick_least_loaded` (active requests), `BlockIndex.pick_kv` of a 1k-token next
turn (3/4 its family's prefix; routed-block tracking on), each followed by its `release`, which is
not timed. time.perf_counter_ns() brackets each call; the median and minimum over `--reps` calls
per round. The counts run in turns, round after round (`--rounds`), and the table reports the
median over rounds of each median, and each count's ratio to the first count's, measured side by
side in one run (the machine is shared).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
import uuid
from array import array

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from shmdisagg import hashing
from shmdisagg.shm.index import BlockIndex, IndexSettings
from shmdisagg.shm.table import ROLE_CONTEXT, ControlTable

TPB = 32


class Table:
    def __init__(self, n: int, families: list[list[int]]) -> None:
        rng = random.Random(n)
        self.n = n
        self.table = ControlTable.create(f"shmdisagg-bps-{uuid.uuid4().hex[:8]}", max_workers=32)
        for s in range(n):
            self.table.publish_server(s, f"127.0.0.1:{9000 + s}", ROLE_CONTEXT, True, max_batch_size=64)
        self.index = BlockIndex.create(self.table, IndexSettings(capacity=1 << 20, max_capacity=1 << 20))
        filler = [rng.getrandbits(64) for _ in range(200_000)]
        for s in range(n):
            self.index.apply_stored(s, array("Q", filler[s::n]).tobytes())
        for f, prefix in enumerate(families):
            self.index.apply_stored(f % n, hashing.block_hashes_bytes(prefix + [0], TPB))
        self.worker = ControlTable.attach(self.table.prefix)
        self.rows = [self.worker.claim_row(os.getpid(), 1) for _ in range(16)]
        for r in self.rows:
            for _ in range(n):
                self.worker.pick_round_robin(r, ROLE_CONTEXT, -1, rng.randrange(1, 500))
        self.wix = BlockIndex.attach(self.worker)
        self.row = self.rows[0]

    def close(self) -> None:
        self.wix.close()
        for r in self.rows:
            self.table.reclaim_row(r)
        self.worker.close()
        self.index.unlink()
        self.index.close()
        self.table.unlink()
        self.table.close()


def round_once(t: Table, prompts: list[tuple[bytes, int]], reps: int) -> dict[str, tuple[float, float]]:
    w, row, clock = t.worker, t.row, time.perf_counter_ns
    out: dict[str, list[int]] = {"pick_round_robin": [], "pick_least_loaded": [], "pick_kv (1k-token next turn)": []}
    for i in range(reps):
        t0 = clock()
        slot = w.pick_round_robin(row, ROLE_CONTEXT, -1, 10)
        out["pick_round_robin"].append(clock() - t0)
        w.release(row, slot, 10)
        t0 = clock()
        slot = w.pick_least_loaded(row, ROLE_CONTEXT, -1, 10, False)
        out["pick_least_loaded"].append(clock() - t0)
        w.release(row, slot, 10)
        hashes, ntok = prompts[i % len(prompts)]
        t0 = clock()
        slot, _ = t.wix.pick_kv(row, ROLE_CONTEXT, -1, hashes, ntok)
        out["pick_kv (1k-token next turn)"].append(clock() - t0)
        w.release(row, slot, ntok)
    return {k: (statistics.median(v) / 1000.0, min(v) / 1000.0) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--servers", default="4,64")
    ap.add_argument("--reps", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    counts = [int(x) for x in args.servers.split(",")]
    rng = random.Random(1)
    families = [[rng.randrange(1000, 100000) for _ in range(768)] for _ in range(16)]
    prompts = []
    for k in range(64):
        tokens = families[k % 16] + [rng.randrange(1000, 100000) for _ in range(256)]
        prompts.append((hashing.block_hashes_bytes(tokens, TPB), len(tokens)))
    tables = [Table(n, families) for n in counts]
    results: dict[int, list[dict[str, tuple[float, float]]]] = {n: [] for n in counts}
    try:
        for r in range(args.rounds):
            order = tables if r % 2 == 0 else list(reversed(tables))
            for t in order:
                results[t.n].append(round_once(t, prompts, args.reps))
    finally:
        for t in tables:
            t.close()
    names = list(results[counts[0]][0])
    print(f"per call, µs: median over {args.rounds} rounds of each round's p50 (min); ratio to {counts[0]} executors")
    print(f"{'call':32}" + "".join(f"{f'{n} executors':>28}" for n in counts))
    for name in names:
        base = statistics.median(rd[name][0] for rd in results[counts[0]])
        cells = []
        for n in counts:
            p50 = statistics.median(rd[name][0] for rd in results[n])
            mn = min(rd[name][1] for rd in results[n])
            cells.append(f"{p50:7.3f} ({mn:6.3f}) x{p50 / base:4.2f}")
        print(f"{name:32}" + "".join(f"{c:>28}" for c in cells))


if __name__ == "__main__":
    main()
