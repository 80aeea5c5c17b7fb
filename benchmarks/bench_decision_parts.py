#!/usr/bin/env python3
"""Parts of a routing decision measured on their own (BENCHMARKS.md, "Decision cost, 1k to 128k
tokens"). Four subcommands:

    .venv/bin/python benchmarks/bench_decision_parts.py ab TREE_A TREE_B [--size 32768] [--reps 400]
    .venv/bin/python benchmarks/bench_decision_parts.py [--tree TREE] create
    .venv/bin/python benchmarks/bench_decision_parts.py [--tree TREE] token-ids
    .venv/bin/python benchmarks/bench_decision_parts.py [--tree TREE] faults [--size 1024]

`--tree` (default: this one) is the checkout whose package, built extension and
`benchmarks/bench_routing.py` the last three use, so an older commit is measured beside this one.

- `ab`: the built `shmdisagg._native` of two trees loaded in one process (as `treea._native` and
  `treeb._native`), hashing the same int32 prompts in alternating order: a next turn through each
  tree's `PrefixHashCache` (3/4 a cached family prefix), the same prompt again (repeat), a new
  prompt (miss) and `block_hashes_v1` directly. Before each timed call 8 MiB of other memory is
  written (as the request's JSON and the previous pick push the cache's lines out) and the
  prompt's ids are read again (validation has just written them). Prints p10 / p50 / min of each
  and the median of the paired differences B - A, which cancels most of the host's noise.
- `create`: `BlockIndex.create` (a coordinator's new generation, with its segment on 2 MiB pages
  where the tree does that) at 2, 32 and 128 MiB: median and minimum of 5.
- `token-ids`: `token_ids_ok` / `token_ids_int32` on a list just parsed by orjson (first pass)
  and again on the same list (second pass, its objects now cached), at 1k, 32k and 128k tokens:
  whether a check is bound by its code or by where the int objects are.
- `faults`: minor page faults and time per `pick_kv` over 600 next turns in a fresh worker mapping
  (`bench_routing.Deployment`): a 4 KiB-page index costs a fault at the first touch of each of
  its pages in every process.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import random
import resource
import statistics
import sys
import time
import uuid
from array import array
from pathlib import Path
from types import ModuleType

from benchkit import count  # this script's directory, sys.path[0]

TREE = Path(__file__).resolve().parents[1]


def q(values: list[int], p: float) -> float:
    s = sorted(values)
    return s[int(p * (len(s) - 1))] / 1000.0


def load_native(tree: str, name: str) -> ModuleType:
    path = next(Path(tree, "shmdisagg").glob("_native.cpython-*.so"))
    loader = importlib.machinery.ExtensionFileLoader(f"{name}._native", str(path))
    spec = importlib.util.spec_from_loader(f"{name}._native", loader)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def ab(args: argparse.Namespace) -> None:
    mods = (load_native(args.tree_a, "treea"), load_native(args.tree_b, "treeb"))
    size, rng = args.size, random.Random(9)
    junk = bytearray(8 << 20)

    def evict(ids: memoryview) -> None:
        junk[::64] = bytes(len(junk) // 64)
        ids.tobytes()

    families = [[rng.randrange(100, 150_000) for _ in range(size * 3 // 4)] for _ in range(16)]
    caches = [m.PrefixHashCache(32, 1 << 18) for m in mods]
    for f in families:
        for c in caches:
            c.block_hashes(memoryview(array("i", f + [1])))
    clock = time.perf_counter_ns
    res: dict[str, tuple[list[int], list[int]]] = {k: ([], []) for k in ("next turn", "repeat", "miss", "direct")}
    for i in range(args.reps):
        tail = [rng.randrange(100, 150_000) for _ in range(size - size * 3 // 4)]
        nt = memoryview(array("i", families[i % 16] + tail))
        new = memoryview(array("i", [rng.randrange(100, 150_000) for _ in range(size)]))
        for which in (0, 1) if i % 2 == 0 else (1, 0):
            c, m = caches[which], mods[which]
            for name, ids in (("next turn", nt), ("repeat", nt), ("miss", new), ("direct", new)):
                evict(ids)
                t0 = clock()
                if name == "direct":
                    m.block_hashes_v1(ids, 32)
                else:
                    c.block_hashes(ids)
                res[name][which].append(clock() - t0)
    for name, (a, b) in res.items():
        d = statistics.median(y - x for x, y in zip(a, b, strict=True)) / 1000.0
        print(
            f"{size:>6} {name:10} A p10/p50/min {q(a, 0.1):6.1f} {q(a, 0.5):6.1f} {min(a) / 1e3:6.1f}   "
            f"B {q(b, 0.1):6.1f} {q(b, 0.5):6.1f} {min(b) / 1e3:6.1f}   B-A median {d:+6.2f} us"
        )


def create(args: argparse.Namespace) -> None:
    from shmdisagg.shm import ControlTable
    from shmdisagg.shm.index import BlockIndex, IndexSettings

    for cap in (1 << 16, 1 << 20, 1 << 22):
        times, huge = [], 0
        for _ in range(5):
            table = ControlTable.create(f"shmdisagg-bench-{uuid.uuid4().hex[:8]}", max_workers=4)
            t0 = time.perf_counter()
            index = BlockIndex.create(table, IndexSettings(capacity=cap, max_capacity=cap))
            times.append(time.perf_counter() - t0)
            huge = getattr(index, "huge_bytes", 0)
            index.close()
            index.unlink()
            table.unlink()
            table.close()
        print(
            f"{cap * 32 >> 20:>4} MiB index: create median {statistics.median(times) * 1e3:6.1f} ms, "
            f"min {min(times) * 1e3:6.1f} ms; {huge >> 20} MiB on 2 MiB pages"
        )


def token_ids(args: argparse.Namespace) -> None:
    import orjson

    from shmdisagg import _native

    rng, clock = random.Random(1), time.perf_counter_ns
    for size in (1024, 32768, 131072):
        first: dict[str, list[int]] = {"ok": [], "int32": []}
        second: dict[str, list[int]] = {"ok": [], "int32": []}
        for r in range(400):
            ids = orjson.loads(orjson.dumps({"prompt": [rng.randrange(100, 150_000) for _ in range(size)]}))["prompt"]
            name = ("int32", "ok")[r % 2]
            fn = _native.token_ids_ok if name == "ok" else _native.token_ids_int32
            t0 = clock()
            fn(ids)
            t1 = clock()
            fn(ids)
            second[name].append(clock() - t1)
            first[name].append(t1 - t0)
        print(
            f"{size:>6} tokens, min / p50 us: "
            + "  ".join(
                f"{n} first {min(first[n]) / 1e3:.1f} / {q(first[n], 0.5):.1f}, second {min(second[n]) / 1e3:.1f} / "
                f"{q(second[n], 0.5):.1f}"
                for n in ("ok", "int32")
            )
        )


def faults(args: argparse.Namespace) -> None:
    from bench_routing import Deployment

    from shmdisagg import hashing
    from shmdisagg.shm import ROLE_CONTEXT

    rng, size = random.Random(5), args.size
    families = [[rng.randrange(100, 150_000) for _ in range(size * 3 // 4)] for _ in range(16)]
    dep = Deployment(argparse.Namespace(tpb=32, capacity=1 << 22), families)
    try:
        hashes = [
            hashing.block_hashes_bytes(families[i % 16] + [rng.randrange(100, 150_000) for _ in range(size // 4)], 32)
            for i in range(600)
        ]
        f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        for h in hashes:
            slot, _ = dep.wix.pick_kv(dep.row, ROLE_CONTEXT, -1, h, size)
            dep.worker.release(dep.row, slot, size)
        t1, f1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        print(
            f"{args.tree}: {size} tokens, 600 next-turn picks: "
            f"{(f1 - f0) / 600:.1f} minor faults a pick, {(t1 - t0) / 600 * 1e6:.1f} us a pick"
        )
    finally:
        dep.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", default=str(TREE), help="checkout measured by create, token-ids, faults")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("ab")
    p.add_argument("tree_a")
    p.add_argument("tree_b")
    p.add_argument("--size", type=count, default=32768)
    p.add_argument("--reps", type=count, default=400)
    sub.add_parser("create")
    sub.add_parser("token-ids")
    p = sub.add_parser("faults")
    p.add_argument("--size", type=count, default=1024)
    args = ap.parse_args()
    sys.path[:0] = [args.tree, str(Path(args.tree) / "benchmarks")]
    {"ab": ab, "create": create, "token-ids": token_ids, "faults": faults}[args.cmd](args)


if __name__ == "__main__":
    main()
