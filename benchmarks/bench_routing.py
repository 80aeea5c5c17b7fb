#!/usr/bin/env python3
"""Routing decision cost and KV-event throughput of the shared block index.

Usage: .venv/bin/python benchmarks/bench_routing.py [--reps 2000] [--sizes 1024,8192,32768,131072]

Decision cost: token-id prompts of each size, parsed from a JSON body by orjson before each
decision (as a fleet worker receives them; the parse itself is not timed), routed with one
`BlockIndex.pick_kv` call (8 context servers, 16 claimed worker rows, routed-block tracking on,
an index of `--capacity` slots holding 400k cached blocks). Prompts come from 16 families: 3/4 of
each prompt is its family's prefix, which a KV event stored on one server, and the last quarter
is new, so every pick walks a long match and then inserts and marks fresh blocks: a
conversation's next turn. time.perf_counter_ns() brackets each timed call; p50/p99/min over
`--reps` decisions after 100 unrecorded ones (which also fill the prefix hash cache).

Groups of rows:
- parts: the validation pass over the freshly parsed list (`token_ids_ok`, which the fleet ran
  before, and `token_ids_int32`, which also produces the int32 ids; half the decisions each), then
  v1 hashing from the list (now read a second time), from the int32 ids, and through a
  PrefixHashCache (next turn: its family prefix cached; repeat: the same prompt again). No picks.
- decisions, before, after and deferred, for next turns (the families) and for new prompts (sharing
  nothing with earlier ones: no cached prefix, no match, the pick inserts every block). Before:
  `validate` (its list check, `token_ids_ok`), `RoutingKey`, `block_hashes_bytes(list)` (what
  `RoutingKey.block_hashes` called), pick. After: `validate(..., want_ids=True)` (one pass that
  checks the list and writes int32 ids), `RoutingKey.block_hashes` (the process's
  PrefixHashCache), pick. Deferred: the after path as the fleet's `kv_cache_aware` router runs
  it in its event loop, the pick stopping at its claim (`pick_kv_claim`) and the routed bits of
  `DEFER_MIN_BLOCKS` blocks or more set by `commit_routed` once the leg is sent (its own row: the
  request does not wait for it). Every request goes through the three paths (parsed once for
  each), each path on its own deployment, taking turns at going first, so all see the same
  prompts and the same interference from other load on the host.

Scaling: after the groups, a table of every "after" row in us per 1k tokens (p50 and min) at each
size, so a part whose cost grows faster than the prompt shows (issue 14: flat from 1k to 128k
tokens except the hashing itself).

KV events: `BlockIndex.apply_stored` / `apply_removed` of random block hashes in events of
`--event-blocks` blocks (bytes ready, the C apply path), then the same from Python int lists
(`pack_hashes` included), reported as block events applied per second.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
import uuid
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import orjson

from benchmarks.benchkit import count, count_or_zero, positive_ints
from shmdisagg import _native, hashing
from shmdisagg.orchestrator.validation import validate
from shmdisagg.routing.kv_cache_aware import DEFER_MIN_BLOCKS
from shmdisagg.routing.policy import RoutingKey
from shmdisagg.shm import ROLE_CONTEXT, ControlTable
from shmdisagg.shm.index import BlockIndex, IndexSettings, pack_hashes

WARMUP = 100


def pct(values: list[int], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] / 1000.0


class Deployment:
    """A control table with 8 context servers and an index holding 400k cached blocks, seen from
    a worker with 16 claimed rows (some load in each, so the load sums are not trivial)."""

    def __init__(self, args: argparse.Namespace, families: list[list[int]]) -> None:
        rng = random.Random(7)
        self.table = ControlTable.create(f"shmdisagg-bench-{uuid.uuid4().hex[:8]}", max_workers=32)
        for s in range(8):
            self.table.publish_server(
                s, f"127.0.0.1:{9000 + s}", ROLE_CONTEXT, True, max_batch_size=64, tokens_per_block=args.tpb
            )
        self.index = BlockIndex.create(self.table, IndexSettings(capacity=args.capacity, max_capacity=args.capacity))
        filler = [rng.getrandbits(64) for _ in range(400_000)]
        for s in range(8):
            self.index.apply_stored(s, array("Q", filler[s::8]).tobytes())
        for f, prefix in enumerate(families):
            self.index.apply_stored(f % 8, hashing.block_hashes_bytes(prefix + [0], args.tpb))
        self.worker = ControlTable.attach(self.table.prefix)
        self.rows = [self.worker.claim_row(os.getpid(), 1) for _ in range(16)]
        for i, r in enumerate(self.rows):
            self.worker.pick_round_robin(r, ROLE_CONTEXT, -1, 100 + i)
        self.wix = BlockIndex.attach(self.worker)
        self.row = self.rows[0]

    def close(self) -> None:
        self.wix.close()
        for r in self.rows:
            self.table.reclaim_row(r)
        self.worker.close()
        self.index.close()
        self.table.unlink()
        self.table.close()


def requests(
    families: list[list[int]], size: int, n: int, rng: random.Random, fresh: bool = False
) -> Iterator[tuple[bool, bytes]]:
    """n request bodies: a family prefix plus a new quarter (or all new tokens)."""
    for i in range(n):
        if fresh:
            prompt = [rng.randrange(100, 150_000) for _ in range(size)]
        else:
            prompt = families[i % len(families)] + [rng.randrange(100, 150_000) for _ in range(size - size * 3 // 4)]
        yield i >= WARMUP, orjson.dumps({"model": "m", "prompt": prompt, "max_tokens": 16})


def parts(families: list[list[int]], size: int, reps: int, tpb: int, rng: random.Random) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {
        k: []
        for k in (
            "token_ids_ok (list check, before)",
            "token_ids_int32 (check + int32)",
            "hash, list",
            "hash, int32, no cache",
            "hash, int32, cache: next turn",
            "hash, int32, cache: repeat",
        )
    }
    cache = hashing.PrefixHashCache(tpb, hashing.PROCESS_CACHE_BLOCKS)
    clock = time.perf_counter_ns
    for record, body in requests(families, size, reps + WARMUP, rng):
        req = orjson.loads(body)
        tokens = req["prompt"]
        # The first pass over a freshly parsed list pays for reading its int objects; the two
        # checks take turns at going first, and only that first pass is recorded.
        first = ("token_ids_ok (list check, before)", "token_ids_int32 (check + int32)")[len(out["hash, list"]) % 2]
        t0 = clock()
        if first.startswith("token_ids_ok"):
            _native.token_ids_ok(tokens)
            t1 = clock()
            ids = _native.token_ids_int32(tokens)
        else:
            ids = _native.token_ids_int32(tokens)
            t1 = clock()
            _native.token_ids_ok(tokens)
        t2 = clock()
        direct = hashing.block_hashes_bytes(tokens, tpb)
        t3 = clock()
        view = memoryview(ids).cast("i")
        hashing.block_hashes_bytes(view, tpb)
        t4 = clock()
        cached = cache.block_hashes(view)
        t5 = clock()
        cache.block_hashes(view)
        t6 = clock()
        assert cached == direct
        if record:
            out[first].append(t1 - t0)
            for k, v in zip(list(out)[2:], (t3 - t2, t4 - t3, t5 - t4, t6 - t5), strict=True):
                out[k].append(v)
        del tokens, ids, direct, view, cached, req  # freed here, not inside the next timed call
    return out


ROWS = ("validate + RoutingKey", "hash", "pick_kv", "hash + pick", "validate + hash + pick")


def path_before(dep: Deployment, req: dict[str, Any], tpb: int) -> tuple[int, ...]:
    """The fleet's hot path before int32 ids: validate() checks the list (token_ids_ok), the
    RoutingKey hashes the list (block_hashes_bytes, what RoutingKey.block_hashes called), pick."""
    clock = time.perf_counter_ns
    t0 = clock()
    validate(req, False)
    key = RoutingKey(len(req["prompt"]), req["prompt"])
    t1 = clock()
    hashes = hashing.block_hashes_bytes(key.token_ids, tpb)
    t2 = clock()
    slot, _ = dep.wix.pick_kv(dep.row, ROLE_CONTEXT, -1, hashes, key.num_tokens)
    t3 = clock()
    dep.worker.release(dep.row, slot, key.num_tokens)
    return t1 - t0, t2 - t1, t3 - t2, t3 - t1, t3 - t0


def path_after(dep: Deployment, req: dict[str, Any], tpb: int, deferred: bool = False) -> tuple[int, ...]:
    """The fleet's hot path now: validate() produces the int32 ids (token_ids_int32), the
    RoutingKey hashes them through the process's PrefixHashCache, pick. `deferred`: see
    path_deferred."""
    clock = time.perf_counter_ns
    t0 = clock()
    ids32 = validate(req, False, want_ids=True)
    key = RoutingKey(len(req["prompt"]), req["prompt"], ids32=ids32)
    t1 = clock()
    hashes = key.block_hashes(tpb)
    t2 = clock()
    if deferred:
        slot, _, start = dep.wix.pick_kv_claim(
            dep.row, ROLE_CONTEXT, -1, hashes, key.num_tokens, 0.25, math.inf, False, True, 0, 0, DEFER_MIN_BLOCKS
        )
    else:
        (slot, _), start = dep.wix.pick_kv(dep.row, ROLE_CONTEXT, -1, hashes, key.num_tokens), -1
    t3 = clock()
    if start >= 0:
        dep.wix.commit_routed(dep.row, hashes, start, slot)
    t4 = clock()
    dep.worker.release(dep.row, slot, key.num_tokens)
    times = (t1 - t0, t2 - t1, t3 - t2, t3 - t1, t3 - t0)
    return (*times, t4 - t3) if deferred else times


DEFERRED_ROWS = ROWS + ("commit_routed (after the send)",)


def path_deferred(dep: Deployment, req: dict[str, Any], tpb: int) -> tuple[int, ...]:
    """The after path as the fleet's router runs it inside its event loop: the pick stops at its
    claim (`pick_kv_claim`) and the routed bits of `DEFER_MIN_BLOCKS` or more blocks are set by
    `commit_routed` once the leg is written (timed apart: the request does not wait for it)."""
    return path_after(dep, req, tpb, deferred=True)


def decisions(
    args: argparse.Namespace, families: list[list[int]], size: int, rng: random.Random, fresh: bool
) -> tuple[dict[str, list[int]], dict[str, list[int]], dict[str, list[int]], int]:
    """The three paths on every request (parsed once for each), each on its own deployment,
    taking turns at going first: all see the same prompts and the same interference from other
    load. Returns their timings and the share (%) of blocks the after path took from its cache."""
    out = ({k: [] for k in ROWS}, {k: [] for k in ROWS}, {k: [] for k in DEFERRED_ROWS})
    paths = (path_before, path_after, path_deferred)
    deps = [Deployment(args, families) for _ in paths]
    # one prefix hash cache per path, as each would be a fleet worker of its own: the after and
    # deferred paths hash the same prompts, and a shared cache would hand the second a repeat
    caches: list[dict[int, Any]] = [{} for _ in paths]
    home = hashing._process_caches
    # New prompts insert every block: fresh deployments every ~600k inserted blocks keep the
    # index's load (0.1-0.25) in the range the other groups see, and far from its insert limit.
    rotate = max(1, 600_000 // ((size + args.tpb - 2) // args.tpb)) if fresh else 1 << 62
    try:
        for n, (record, body) in enumerate(requests(families, size, args.reps + WARMUP, rng, fresh)):
            if n and n % rotate == 0:
                for i in range(len(deps)):
                    deps[i].close()
                    deps[i] = Deployment(args, families)
            for j in range(len(paths)):
                i = (n + j) % len(paths)
                req = orjson.loads(body)
                hashing._process_caches = caches[i]
                times = paths[i](deps[i], req, args.tpb)
                del req  # the request's objects die with it, untimed
                if record:
                    for k, v in zip(out[i], times, strict=True):
                        out[i][k].append(v)
        cache = caches[1].get(args.tpb)  # the after path's; none below CACHE_MIN_BLOCKS blocks
        stats = cache.stats if cache is not None else {"blocks_reused": 0, "blocks_hashed": 0}
        reused = stats["blocks_reused"] * 100 // max(1, stats["blocks_reused"] + stats["blocks_hashed"])
    finally:
        hashing._process_caches = home
        for d in deps:
            d.close()
    return out[0], out[1], out[2], reused


def show(title: str, rows: dict[str, list[int]]) -> None:
    print(f"  {title}")
    for name, values in rows.items():
        if not name.startswith("_"):
            print(f"    {name:38} {pct(values, 0.5):>7.1f}us {pct(values, 0.99):>7.1f}us {min(values) / 1000:>7.1f}us")


def show_scaling(scaling: dict[int, dict[str, list[int]]]) -> None:
    """Every "after" row in us per 1k tokens (p50 / min) at each size."""
    if len(scaling) < 2:
        return
    sizes = sorted(scaling)
    print("\nus per 1k tokens, p50 / min (the after path; a row growing to the right grows faster than the prompt):")
    print(f"    {'':38} " + " ".join(f"{s:>13}" for s in sizes))
    for name in scaling[sizes[0]]:
        cells = []
        for s in sizes:
            v = scaling[s].get(name)
            cells.append(f"{pct(v, 0.5) * 1024 / s:6.2f}/{min(v) / 1000 * 1024 / s:<6.2f}" if v else " " * 13)
        print(f"    {name:38} " + " ".join(cells))


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
    ap.add_argument("--reps", type=count, default=2000)
    ap.add_argument("--sizes", default="1024,8192,32768,131072")
    ap.add_argument("--tpb", type=count, default=32, help="tokens per block")
    ap.add_argument("--capacity", type=count, default=1 << 22, help="index slots")
    ap.add_argument("--event-blocks", type=count, default=32, help="blocks per KV event")
    ap.add_argument("--events", type=count_or_zero, default=1_000_000, help="block events to apply (0: skip)")
    args = ap.parse_args()
    sizes = positive_ints(ap, "--sizes", args.sizes)
    rng = random.Random(20261130)
    print(
        f"host: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}, load average "
        f"{os.getloadavg()[0]:.2f}; index {args.capacity} slots with 400k cached blocks, 8 servers, "
        f"16 claimed rows, tokens_per_block {args.tpb}, {args.reps} decisions per group\n"
    )
    scaling: dict[int, dict[str, list[int]]] = {}
    for size in sizes:
        families = [[rng.randrange(100, 150_000) for _ in range(size * 3 // 4)] for _ in range(16)]
        print(f"{size} tokens ({(size - 1 + args.tpb - 1) // args.tpb} blocks, 3/4 of them a cached family prefix):")
        print(f"    {'':38} {'p50':>9} {'p99':>9} {'min':>9}")
        p = parts(families, size, args.reps, args.tpb, rng)
        show("parts (no picks)", p)
        scaling[size] = {k: v for k, v in p.items() if "before" not in k}
        for fresh in (False, True):
            b, a, d, reused = decisions(args, families, size, rng, fresh)
            scaling[size].update({f"{'new' if fresh else 'next'}: {k}": v for k, v in a.items()})
            what = "new prompts (no shared prefix, no match)" if fresh else "next turns (3/4 a cached prefix)"
            show(f"{what}, before: validate (token_ids_ok) -> block_hashes_bytes(list) -> pick_kv", b)
            cached = (
                f"PrefixHashCache ({reused}% of blocks reused)"
                if size > hashing.CACHE_MIN_BLOCKS * args.tpb
                else "block_hashes_bytes(int32, under CACHE_MIN_BLOCKS)"
            )
            show(f"{what}, after: validate (token_ids_int32) -> {cached} -> pick_kv", a)
            show(f"{what}, deferred: the same -> pick_kv_claim; commit_routed after the send", d)
    show_scaling(scaling)
    if args.events:
        dep = Deployment(args, [])
        try:
            print(f"\nKV events, {args.events} block events in events of {args.event_blocks} blocks:")
            for name, rate in event_rates(dep.index, args.events, args.event_blocks, rng).items():
                print(f"  {name:<22} {rate / 1e6:6.2f} M block events/s")
            st = dep.index.stats()
            print(
                f"  event-to-visibility lag of 10,000 events stamped just before applying: p50 <= "
                f"{st.lag_quantile_ns(0.5) / 1000:.1f} us, p99 <= {st.lag_quantile_ns(0.99) / 1000:.1f} us"
            )
        finally:
            dep.close()


if __name__ == "__main__":
    main()
