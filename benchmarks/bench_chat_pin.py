#!/usr/bin/env python
"""What the kv_cache_aware router's chat pins cost a decision (`routing/affinity.py`,
`BlockIndex.pick_kv`'s `pin_key`): the key of a chat, and a pick with a pin against one without,
side by side, alternating, in one process (8 context servers, 400k cached blocks, 4k-token
prompts of 50 families; pins for 10,000 conversations).

    .venv/bin/python benchmarks/bench_chat_pin.py [--reps 20000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_routing import Deployment
from benchmarks.benchkit import count
from shmdisagg import hashing
from shmdisagg.routing.affinity import content_affinity_key
from shmdisagg.shm.table import ROLE_CONTEXT

CHAT = {
    "messages": [
        {"role": "system", "content": "You are a helpful assistant who answers briefly. " * 12},
        {"role": "user", "content": "Explain what a KV cache holds and why it matters. " * 4},
        {"role": "assistant", "content": "It holds attention keys and values. " * 10},
        {"role": "user", "content": "And across turns?"},
    ]
}


def per_call_us(fn, n: int) -> float:  # type: ignore[no-untyped-def]
    t = time.perf_counter()
    for i in range(n):
        fn(i)
    return (time.perf_counter() - t) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=count, default=20_000)
    ap.add_argument("--rounds", type=count, default=5)
    args = ap.parse_args()
    rng = random.Random(3)
    tpb = 32
    families = [[rng.randrange(32_000) for _ in range(4096)] for _ in range(50)]
    dep = Deployment(argparse.Namespace(tpb=tpb, capacity=1 << 21), families)
    hashes = [hashing.block_hashes_bytes(f + [1], tpb) for f in families]
    pins = [rng.getrandbits(63) + 1 for _ in range(10_000)]
    ix, row, table = dep.wix, dep.row, dep.worker

    def pick(i: int, pin: int) -> None:
        slot, _ = ix.pick_kv(row, ROLE_CONTEXT, -1, hashes[i % 50], 4096, 0.25, float("inf"), False, False, 64, pin)
        table.release(row, slot, 4096)

    try:
        key, plain, pinned = [], [], []
        for _ in range(args.rounds):
            key.append(per_call_us(lambda i: content_affinity_key(CHAT), args.reps))
            plain.append(per_call_us(lambda i: pick(i, 0), args.reps))
            pinned.append(per_call_us(lambda i: pick(i, pins[i % len(pins)]), args.reps))
    finally:
        dep.close()
    k, a, b = (statistics.median(x) for x in (key, plain, pinned))
    chars = sum(len(m["content"]) for m in CHAT["messages"][:2])
    print(f"µs, median of {args.rounds} rounds of {args.reps}:")
    print(f"  the chat's key ({chars} characters in its first two messages): {k:.2f}")
    print(f"  pick_kv of a 4k-token prompt: {a:.2f} without a pin, {b:.2f} with one ({b / a:.2f}x)")


if __name__ == "__main__":
    main()
