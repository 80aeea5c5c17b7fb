#!/usr/bin/env python3
"""Cost of one `kv_cache_aware` routing decision through the policy, as a fleet worker makes it.

Usage: PYTHONPATH=TREE .venv/bin/python TREE/benchmarks/bench_kv_policy.py [--reps 3000] [--sizes 1024,8192]
       [--algos v1_block_key]

Times `RoutingKey(...)` from a request's int32 ids, `KvCacheAwarePolicy.pick` (hashing through
the role's algorithm and the native `pick_kv`) and the release, per decision, over next turns
(3/4 of each prompt a family prefix one server holds by KV events, as in `bench_routing.py`,
whose `Deployment` it uses: 8 context servers, 16 claimed rows, 400k cached blocks). p50 / p99 /
min in µs after 100 unrecorded decisions. Runs against whichever tree PYTHONPATH names, so an
older commit can be measured side by side (it takes the policy's older signature). `--algos`
other than v1_block_key need a tree that has them.

`--ab` (this tree only): decisions in pairs, one through the policy and one through what the
policy did before the per-role routing key (`RoutingKey.block_hashes(tpb)` and a 9-argument
`pick_kv`, the release likewise), each on its own prompt of a different family, taking turns at
going first, so both see the same load on the host; prints both and the difference (the mean of
the two orders' median per-pair differences, which cancels the second call's warmer caches).
"""

from __future__ import annotations

import argparse
import inspect
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_routing import WARMUP, Deployment, pct
from benchkit import count, name_list, positive_ints

from shmdisagg import _native
from shmdisagg.config import RouterConfig
from shmdisagg.hashing import KV_CACHE_HASH_ALGOS
from shmdisagg.routing import make_policy
from shmdisagg.routing.policy import RoutingKey
from shmdisagg.shm import ROLE_CONTEXT


def policy_for(dep: Deployment, tpb: int, algo: str):  # type: ignore[no-untyped-def]
    args = RouterConfig(type="kv_cache_aware", tokens_per_block=tpb)
    params = inspect.signature(make_policy).parameters
    if "key_config" in params:
        from shmdisagg.routing.kv_cache_aware import RoutingKeyConfig

        cfg = RoutingKeyConfig(tpb, algo)
        keys = {ROLE_CONTEXT: cfg}
        return make_policy(dep.worker, dep.row, ROLE_CONTEXT, args, dep.wix, lambda: keys.get(ROLE_CONTEXT))
    if algo != "v1_block_key":
        raise SystemExit(f"this tree has no {algo}")
    return make_policy(dep.worker, dep.row, ROLE_CONTEXT, args, dep.wix, lambda: tpb)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=count, default=3000)
    ap.add_argument("--sizes", default="1024,8192")
    ap.add_argument("--algos", default="v1_block_key")
    ap.add_argument("--tpb", type=count, default=32)
    ap.add_argument("--capacity", type=count, default=1 << 22)
    ap.add_argument("--ab", action="store_true")
    args = ap.parse_args()
    sizes = positive_ints(ap, "--sizes", args.sizes)
    algos = name_list(ap, "--algos", args.algos, KV_CACHE_HASH_ALGOS)
    rng = random.Random(11)
    for size in sizes:
        families = [[rng.randrange(100, 150_000) for _ in range(size * 3 // 4)] for _ in range(16)]
        dep = Deployment(args, families)
        try:
            if args.ab:
                ab(dep, families, size, args, rng)
                continue
            for algo in algos:
                policy = policy_for(dep, args.tpb, algo)
                times = []
                clock = time.perf_counter_ns
                for i in range(args.reps + WARMUP):
                    prompt = families[i % len(families)] + [
                        rng.randrange(100, 150_000) for _ in range(size - size * 3 // 4)
                    ]
                    ids32 = _native.token_ids_int32(prompt)
                    t0 = clock()
                    key = RoutingKey(len(prompt), prompt, ids32=ids32)
                    slot = policy.pick(key, -1)
                    policy.release(slot, key)
                    t1 = clock()
                    if i >= WARMUP:
                        times.append(t1 - t0)
                print(
                    f"{size:>6} tokens {algo:<13} pick+release us p50 {pct(times, 0.5):7.1f}  p99 "
                    f"{pct(times, 0.99):7.1f}  min {min(times) / 1000:7.1f}"
                )
        finally:
            dep.close()


def ab(dep: Deployment, families: list[list[int]], size: int, args: argparse.Namespace, rng: random.Random) -> None:
    policy = policy_for(dep, args.tpb, "v1_block_key")
    a = policy.args
    clock = time.perf_counter_ns
    times: dict[str, list[int]] = {"old": [], "new": []}
    diffs: dict[bool, list[int]] = {True: [], False: []}  # by whether the new path went first
    half = len(families) // 2
    for i in range(args.reps + WARMUP):
        new_first = bool(i % 2)
        t = {}
        for n, which in enumerate(("new", "old") if new_first else ("old", "new")):
            # each path its own prompt, of a family the other path did not just touch
            fam = families[(i + n * half) % len(families)]
            prompt = fam + [rng.randrange(100, 150_000) for _ in range(size - size * 3 // 4)]
            ids32 = _native.token_ids_int32(prompt)
            t0 = clock()
            key = RoutingKey(len(prompt), prompt, ids32=ids32)
            if which == "new":
                slot = policy.pick(key, -1)
                policy.release(slot, key)
            else:
                slot, _ = dep.wix.pick_kv(
                    dep.row,
                    ROLE_CONTEXT,
                    -1,
                    key.block_hashes(a.tokens_per_block),
                    key.num_tokens,
                    a.load_weight,
                    a.load_cap,
                    a.use_tokens,
                    a.track_routed_blocks,
                )
                dep.worker.release(dep.row, slot, key.num_tokens)
            t[which] = clock() - t0
        if i >= WARMUP:
            for which in t:
                times[which].append(t[which])
            diffs[new_first].append(t["new"] - t["old"])
    for name, which in (("before (direct)", "old"), ("after (policy)", "new")):
        xs = times[which]
        print(
            f"{size:>6} tokens {name:<16} us p50 {pct(xs, 0.5):7.1f}  p99 {pct(xs, 0.99):7.1f}  min "
            f"{min(xs) / 1000:7.1f}"
        )
    # the second call of a pair runs warmer; averaging both orders' medians cancels that
    d = (pct(diffs[True], 0.5) + pct(diffs[False], 0.5)) / 2
    print(f"{size:>6} tokens after - before: {d:+.2f} us (mean of the two orders' median differences)")


if __name__ == "__main__":
    main()
