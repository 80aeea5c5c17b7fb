#!/usr/bin/env python3
"""The cost of one pick as the number of executors grows (issue 15: a table that grows).

Usage: .venv/bin/python benchmarks/bench_pick_servers.py [--servers 4,64,256] [--reps 20000] [--rounds 5]
           [--instructions] [--tree PATH]

For each executor count N: a control table with N healthy context servers and 16 claimed worker
rows (every row carrying some load on every server, so the load sums are real), and a KV block
index of 2^20 slots holding 200k cached blocks spread over the servers plus 16 prompt families
(each 1k-token family prefix stored on one server). The table has the fewest server slots that
hold N (64 up to 64 executors, else the next multiple of 64), as a deployment sizes it; `N@S`
(e.g. `4@256`) gives it S slots instead, to price a wide table with few executors. Timed, per
call, from one worker's view: `pick_round_robin`, `pick_least_loaded` (active requests),
`BlockIndex.pick_kv` of a 1k-token next turn (3/4 its family's prefix; routed-block tracking on),
each followed by its `release`, which is not timed. time.perf_counter_ns() brackets each call;
the median and minimum over `--reps` calls per round. The counts run in turns, round after round
(`--rounds`), and the table reports the median over rounds of each median, and each count's
ratio to the first count's, measured side by side in one run (the machine is shared).

`--instructions`: instead of timing, count the instructions of the native pick functions
(`Region_pick_round_robin`, `Region_pick_least_loaded`, `Index_pick_kv`, inclusive of what they
call) per call with valgrind's callgrind, one run per count: repeatable to the instruction, so
it resolves a change a loaded machine's timing cannot. `--tree PATH` imports shmdisagg from
another checkout (built in place) to compare builds; a build whose table has no `max_servers`
runs counts up to 64 only.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from array import array
from pathlib import Path

from benchkit import checkout, count  # this script's directory, sys.path[0]

TPB = 32
FUNCTIONS = {
    "pick_round_robin": "Region_pick_round_robin",
    "pick_least_loaded": "Region_pick_least_loaded",
    "pick_kv (1k-token next turn)": "Index_pick_kv",
}


def parse_counts(spec: str) -> list[tuple[int, int | None]]:
    """ "4,64,4@256" -> [(4, None), (64, None), (4, 256)]: executors, and server slots if given."""
    out: list[tuple[int, int | None]] = []
    for part in spec.split(","):
        n, _, slots = part.partition("@")
        try:
            count, table = int(n), int(slots) if slots else None
        except ValueError:
            raise argparse.ArgumentTypeError(f"N or N@slots, comma-separated, got {spec!r}") from None
        if count < 1 or (table is not None and table < count):
            raise argparse.ArgumentTypeError(f"at least 1 executor, and no more than its slots, got {part!r}")
        out.append((count, table))
    return out


def label(n: int, slots: int | None) -> str:
    return f"{n} executors" + (f" (table of {slots})" if slots else "")


class Table:
    def __init__(self, n: int, slots: int | None, families: list[list[int]]) -> None:
        from shmdisagg import hashing
        from shmdisagg.shm import layout
        from shmdisagg.shm.index import BlockIndex, IndexSettings
        from shmdisagg.shm.table import ROLE_CONTEXT, ControlTable

        rng = random.Random(n)
        self.n = n
        prefix = f"shmdisagg-bps-{uuid.uuid4().hex[:8]}"
        wide = getattr(layout, "servers_for", None)
        if wide is None:  # a build before the widening: 64 slots, no max_servers argument
            if n > 64 or (slots or 64) != 64:
                raise SystemExit(f"{label(n, slots)}: this build's table holds 64 servers")
            self.table = ControlTable.create(prefix, max_workers=32)
        else:
            self.table = ControlTable.create(prefix, max_workers=32, max_servers=slots or wide(n))
        for s in range(n):
            self.table.publish_server(s, f"127.0.0.1:{9000 + s}", ROLE_CONTEXT, True, max_batch_size=64)
        self.index = BlockIndex.create(self.table, IndexSettings(capacity=1 << 20, max_capacity=1 << 20))
        filler = [rng.getrandbits(64) for _ in range(200_000)]
        for s in range(n):
            self.index.apply_stored(s, array("Q", filler[s::n]).tobytes())
        for f, prefix_tokens in enumerate(families):
            self.index.apply_stored(f % n, hashing.block_hashes_bytes(prefix_tokens + [0], TPB))
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
    from shmdisagg.shm.table import ROLE_CONTEXT

    w, row, clock = t.worker, t.row, time.perf_counter_ns
    out: dict[str, list[int]] = {name: [] for name in FUNCTIONS}
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


def workload() -> tuple[list[list[int]], list[tuple[bytes, int]]]:
    from shmdisagg import hashing

    rng = random.Random(1)
    families = [[rng.randrange(1000, 100000) for _ in range(768)] for _ in range(16)]
    prompts = []
    for k in range(64):
        tokens = families[k % 16] + [rng.randrange(1000, 100000) for _ in range(256)]
        prompts.append((hashing.block_hashes_bytes(tokens, TPB), len(tokens)))
    return families, prompts


def timed(counts: list[tuple[int, int | None]], reps: int, rounds: int) -> None:
    families, prompts = workload()
    tables = [Table(n, slots, families) for n, slots in counts]
    results: dict[str, list[dict[str, tuple[float, float]]]] = {label(n, s): [] for n, s in counts}
    try:
        for r in range(rounds):
            order = list(zip(counts, tables, strict=True))
            for (n, slots), t in order if r % 2 == 0 else reversed(order):
                results[label(n, slots)].append(round_once(t, prompts, reps))
    finally:
        for t in tables:
            t.close()
    first = label(*counts[0])
    print(f"per call, µs: median over {rounds} rounds of each round's p50 (min); ratio to {first}")
    print(f"{'call':32}" + "".join(f"{k:>30}" for k in results))
    for name in FUNCTIONS:
        base = statistics.median(rd[name][0] for rd in results[first])
        cells = []
        for rounds_of in results.values():
            p50 = statistics.median(rd[name][0] for rd in rounds_of)
            mn = min(rd[name][1] for rd in rounds_of)
            cells.append(f"{p50:7.3f} ({mn:6.3f}) x{p50 / base:4.2f}")
        print(f"{name:32}" + "".join(f"{c:>30}" for c in cells))


def only(n: int, slots: int | None, reps: int) -> None:
    """One table, `reps` calls of each pick, no output (the run callgrind counts)."""
    families, prompts = workload()
    t = Table(n, slots, families)
    try:
        round_once(t, prompts, reps)
    finally:
        t.close()


def _counted(n: int, slots: int | None, reps: int, tree: Path | None) -> dict[str, int]:
    """Instructions of each native pick function (inclusive) in one run of `reps` calls each,
    counted by callgrind. The set-up's own picks (loading the rows) are counted too."""
    with tempfile.NamedTemporaryFile(suffix=".callgrind") as out:
        cmd = ["valgrind", "--tool=callgrind", "--collect-atstart=no", f"--callgrind-out-file={out.name}"]
        cmd += [f"--toggle-collect={fn}" for fn in FUNCTIONS.values()]
        cmd += [sys.executable, __file__, "--only", f"{n}@{slots}" if slots else str(n), "--reps", str(reps)]
        cmd += ["--tree", tree] if tree else []
        subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "PYTHONHASHSEED": "0"})
        text = subprocess.run(
            ["callgrind_annotate", "--inclusive=yes", out.name], check=True, capture_output=True, text=True
        ).stdout
    counts = {}
    for name, fn in FUNCTIONS.items():
        m = re.search(r"^\s*([\d,]+) .*:" + fn + r"\b", text, re.MULTILINE)
        counts[name] = int(m.group(1).replace(",", "")) if m else 0
    return counts


def instructions(counts: list[tuple[int, int | None]], reps: int, tree: Path | None) -> None:
    """Per call: (a run of 3 x reps calls - a run of reps calls) / (2 x reps), so the set-up
    (identical in both runs, its picks included) cancels out."""
    print(f"instructions per call (valgrind callgrind, inclusive: runs of {3 * reps} minus {reps} calls)")
    print(f"{'call':32}" + "".join(f"{label(n, s):>30}" for n, s in counts))
    per: dict[str, list[float]] = {name: [] for name in FUNCTIONS}
    for n, slots in counts:
        short, long = _counted(n, slots, reps, tree), _counted(n, slots, 3 * reps, tree)
        for name in FUNCTIONS:
            per[name].append((long[name] - short[name]) / (2 * reps))
    for name, values in per.items():
        print(f"{name:32}" + "".join(f"{v:30.0f}" for v in values))


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument(
        "--servers", type=parse_counts, default="4,64,256", help="executor counts, N or N@slots, comma-separated"
    )
    ap.add_argument("--reps", type=count, default=20000)
    ap.add_argument("--rounds", type=count, default=5)
    ap.add_argument("--instructions", action="store_true", help="count instructions (valgrind) instead of timing")
    ap.add_argument("--tree", type=checkout, help="import shmdisagg from this checkout (built in place)")
    ap.add_argument("--only", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sys.path.insert(0, str(args.tree) if args.tree else os.path.join(os.path.dirname(__file__), ".."))
    if args.only:
        ((n, slots),) = parse_counts(args.only)
        only(n, slots, args.reps)
    elif args.instructions:
        instructions(args.servers, args.reps, args.tree)
    else:
        timed(args.servers, args.reps, args.rounds)


if __name__ == "__main__":
    main()
