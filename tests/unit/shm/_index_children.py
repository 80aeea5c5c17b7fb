"""Child processes for the block index's multi-process tests (multiprocessing "spawn" targets).

Each child attaches to the table and the published index by prefix, claims its own row, does its
part and reports through a queue; the parent asserts. Crashes stay in the child.
"""

from __future__ import annotations

import math
import os
from typing import Any

from shmdisagg.shm import ROLE_CONTEXT, ControlTable
from shmdisagg.shm.index import BlockIndex, pack_hashes


def chain(tag: int, n: int) -> bytes:
    return pack_hashes([(tag << 32) | (i + 1) for i in range(n)])


def _attach(prefix: str) -> tuple[ControlTable, int, BlockIndex]:
    table = ControlTable.attach(prefix)
    row = table.claim_row(os.getpid(), 1)
    return table, row, BlockIndex.attach(table)


def racer(prefix: str, rounds: int, mode: str, barrier: Any, arrived: Any, results: Any) -> None:
    """Each round: meet the other racer (a blocking barrier, then a spin on a shared counter so
    both start within a fraction of a microsecond), then route round r's fresh prefix (mode
    "kv") or conversation (mode "conv"); report [(slot, matched)] per round."""
    table, row, ix = _attach(prefix)
    picks = []
    try:
        for r in range(rounds):
            hashes = chain(1000 + r, 64)
            barrier.wait()
            with arrived.get_lock():
                arrived.value += 1
            while arrived.value < 2 * (r + 1):
                pass
            if mode == "kv":
                slot, matched = ix.pick_kv(row, ROLE_CONTEXT, -1, hashes, 10)
            else:
                slot, matched = ix.conv_pick_explicit(row, ROLE_CONTEXT, -1, 5000 + r, 10), 0
            table.release(row, slot, 10)
            picks.append((slot, matched))
        results.put((os.getpid(), picks))
    finally:
        ix.close()
        table.close()


def picker(prefix: str, tag: int, blocks: int, want: int, counter: Any, stop: Any, results: Any) -> None:
    """Pick the prefix `tag` (held by server `want` only) until told to stop, counting picks in
    `counter` and wrong answers; report (picks, wrong, generations seen)."""
    table, row, ix = _attach(prefix)
    hashes = chain(tag, blocks)
    picks = wrong = 0
    generations = {ix.generation}
    try:
        while not stop.is_set():
            slot, matched = ix.pick_kv(row, ROLE_CONTEXT, -1, hashes, 1, 0.0, math.inf, False, False)
            table.release(row, slot, 1)
            wrong += (slot, matched) != (want, blocks)
            picks += 1
            generations.add(ix.generation)
            with counter.get_lock():
                counter.value += 1
        results.put((picks, wrong, sorted(generations)))
    finally:
        ix.close()
        table.close()
