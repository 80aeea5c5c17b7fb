#!/usr/bin/env python3
"""Routing decision cost and KV-event throughput of the shared block index.

Usage: .venv/bin/python scripts/bench_routing.py [--reps 2000] [--sizes 1024,8192,32768]

Decision cost: token-id prompts of each size, parsed from JSON by orjson before each timed call
(as a fleet worker receives them), hashed with v1_block_key (`hashing.block_hashes_bytes`) and
routed with one `BlockIndex.pick_kv` call (8 context servers, 16 claimed worker rows, routed-block
tracking on). Prompts come from 16 families: 3/4 of each prompt is its family's prefix, which a
KV event stored on one server, and the last quarter is new, so every pick walks a long match and
then inserts and marks fresh blocks. time.perf_counter_ns() brackets each call; p50/p99 over
`--reps` calls after a warm-up. The same prompt is also hashed from an int32 buffer, and through
a PrefixHashCache (list: its family prefix cached; int32: a repeat of that prompt).

KV events: `BlockIndex.apply_stored` / `apply_removed` of random block hashes in events of
`--event-blocks` blocks (bytes ready, the C apply path), then the same from Python int lists
(`pack_hashes` included), reported as block events applied per second.
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import orjson  # noqa: E402

from shmdisagg import hashing  # noqa: E402
from shmdisagg.shm import ROLE_CONTEXT, ControlTable  # noqa: E402
from shmdisagg.shm.index import BlockIndex, IndexSettings, pack_hashes  # noqa: E402


def pct(values: list[int], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] / 1000.0


def decision_costs(table: ControlTable, index: BlockIndex, size: int, reps: int, tpb: int,
                   rng: random.Random) -> dict[str, list[int]]:
    worker = ControlTable.attach(table.prefix)
    rows = [worker.claim_row(os.getpid(), 1) for _ in range(16)]
    for i, r in enumerate(rows):  # some load in every row, so the load sums are not trivial
        worker.pick_round_robin(r, ROLE_CONTEXT, -1, 100 + i)
    wix = BlockIndex.attach(worker)
    row = rows[0]
    cache = hashing.PrefixHashCache(tpb)
    families = []
    for f in range(16):
        prefix = [rng.randrange(100, 150_000) for _ in range(size * 3 // 4)]
        families.append(prefix)
        index.apply_stored(f % 8, hashing.block_hashes_bytes(prefix + [0], tpb))
    keys = ["hash, list", "hash, int32 buffer", "hash, PrefixHashCache, list",
            "hash, PrefixHashCache, int32", "pick_kv", "hash + pick, list",
            "hash + pick, PrefixHashCache, int32"]
    out: dict[str, list[int]] = {k: [] for k in keys}
    matched = []
    for i in range(reps + 100):
        prompt = families[i % 16] + [rng.randrange(100, 150_000) for _ in range(size - size * 3 // 4)]
        tokens = orjson.loads(orjson.dumps({"prompt": prompt}))["prompt"]
        del prompt
        buf = array("i", tokens)
        t0 = time.perf_counter_ns()
        hashes = hashing.block_hashes_bytes(tokens, tpb)
        t1 = time.perf_counter_ns()
        slot, m = wix.pick_kv(row, ROLE_CONTEXT, -1, hashes, len(tokens))
        t2 = time.perf_counter_ns()
        worker.release(row, slot, len(tokens))
        t3 = time.perf_counter_ns()
        hashing.block_hashes_bytes(buf, tpb)
        t4 = time.perf_counter_ns()
        cache.block_hashes(tokens)
        t5 = time.perf_counter_ns()
        cached = cache.block_hashes(buf)  # the same prompt again: a repeat
        t6 = time.perf_counter_ns()
        assert cached == hashes
        if i >= 100:
            out["hash, list"].append(t1 - t0)
            out["pick_kv"].append(t2 - t1)
            out["hash + pick, list"].append(t2 - t0)
            out["hash, int32 buffer"].append(t4 - t3)
            out["hash, PrefixHashCache, list"].append(t5 - t4)
            out["hash, PrefixHashCache, int32"].append(t6 - t5)
            out["hash + pick, PrefixHashCache, int32"].append(t6 - t5 + t2 - t1)
            matched.append(m)
    out["matched"] = matched
    wix.close()
    for r in rows:
        table.reclaim_row(r)
    worker.close()
    return out


def event_rates(index: BlockIndex, blocks: int, per_event: int, rng: random.Random) -> dict[str, float]:
    hashes = [rng.getrandbits(64) for _ in range(blocks)]
    events = [array("Q", hashes[i : i + per_event]).tobytes() for i in range(0, blocks, per_event)]
    lists = [hashes[i : i + per_event] for i in range(0, blocks, per_event)]
    rates = {}
    t0 = time.perf_counter()
    for i, ev in enumerate(events):
        index.apply_stored(i % 8, ev)
    t1 = time.perf_counter()
    for i, ev in enumerate(events):
        index.apply_removed(i % 8, ev)
    t2 = time.perf_counter()
    rates["stored, packed bytes"] = blocks / (t1 - t0)
    rates["removed, packed bytes"] = blocks / (t2 - t1)
    t0 = time.perf_counter()
    for i, lst in enumerate(lists):
        index.apply_stored(i % 8, pack_hashes(lst))
    t1 = time.perf_counter()
    for i, lst in enumerate(lists):
        index.apply_removed(i % 8, pack_hashes(lst))
    t2 = time.perf_counter()
    rates["stored, int lists"] = blocks / (t1 - t0)
    rates["removed, int lists"] = blocks / (t2 - t1)
    for i, ev in enumerate(events[:10_000]):  # lag: each event stamped just before it is applied
        index.apply_stored(i % 8, ev, time.time_ns())
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--sizes", default="1024,8192,32768")
    ap.add_argument("--tpb", type=int, default=32, help="tokens per block")
    ap.add_argument("--capacity", type=int, default=1 << 22, help="index slots")
    ap.add_argument("--event-blocks", type=int, default=32, help="blocks per KV event")
    ap.add_argument("--events", type=int, default=1_000_000, help="block events to apply")
    args = ap.parse_args()
    rng = random.Random(20261130)
    prefix = f"shmdisagg-bench-{uuid.uuid4().hex[:8]}"
    table = ControlTable.create(prefix, max_workers=32)
    index = None
    try:
        for s in range(8):
            table.publish_server(s, f"127.0.0.1:{9000 + s}", ROLE_CONTEXT, True, max_batch_size=64,
                                 tokens_per_block=args.tpb)
        index = BlockIndex.create(table, IndexSettings(capacity=args.capacity, max_capacity=args.capacity))
        # a populated index: 400k cached blocks spread over the servers
        filler = [rng.getrandbits(64) for _ in range(400_000)]
        for s in range(8):
            index.apply_stored(s, array("Q", filler[s::8]).tobytes())
        print(f"host: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}; index {args.capacity} slots, "
              f"8 servers, 16 claimed rows, tokens_per_block {args.tpb}, {args.reps} decisions per size\n")
        for size in (int(x) for x in args.sizes.split(",")):
            c = decision_costs(table, index, size, args.reps, args.tpb, rng)
            matched = statistics.median(c.pop("matched"))
            print(f"{size} tokens ({(size - 1 + args.tpb - 1) // args.tpb} blocks, median match "
                  f"{matched:.0f}):")
            print(f"  {'':38} {'p50':>9} {'p99':>9} {'min':>9}")
            for name, values in c.items():
                print(f"  {name:38} {pct(values, .5):>7.1f}us {pct(values, .99):>7.1f}us "
                      f"{min(values) / 1000:>7.1f}us")
        census = index.sweep()
        print(f"\nindex after the decisions: {census['used']} keys, load {census['used'] / index.capacity:.2f}, "
              f"max probe {census['max_probe']}")
        print(f"\nKV events, {args.events} block events in events of {args.event_blocks} blocks:")
        for name, rate in event_rates(index, args.events, args.event_blocks, rng).items():
            print(f"  {name:<22} {rate / 1e6:6.2f} M block events/s")
        st = index.stats()
        print(f"  event-to-visibility lag of 10,000 events stamped just before applying: p50 <= "
              f"{st.lag_quantile_ns(0.5) / 1000:.1f} us, p99 <= {st.lag_quantile_ns(0.99) / 1000:.1f} us")
    finally:
        if index is not None:
            index.close()
        table.unlink()
        table.close()


if __name__ == "__main__":
    main()
