"""In-memory Python model of the KV block index (tests only, no shared memory).

A dict from table key to [event_mask, routed_mask] for block hashes: the same inputs as the
native `Index` (stored / removed / all-cleared / clear-server events, routed marks from picks,
TTL expiry, compaction) give the same masks, and the same prefix depths per server: by the
linear walk (`Index.match`) and by pick_kv's jump walk (`jump_depths`).
"""

from __future__ import annotations

from collections.abc import Iterable


def table_key(block_hash: int) -> int:
    """The index stores a block hash of 0 as 1 (0 marks an empty slot)."""
    return block_hash or 1


class IndexModel:
    def __init__(self) -> None:
        self.slots: dict[int, list[int]] = {}  # key -> [event_mask, routed_mask]

    def stored(self, slot: int, hashes: Iterable[int]) -> int:
        n = 0
        for h in hashes:
            self.slots.setdefault(table_key(h), [0, 0])[0] |= 1 << slot
            n += 1
        return n

    def removed(self, slot: int, hashes: Iterable[int]) -> int:
        found = 0
        for h in hashes:
            masks = self.slots.get(table_key(h))
            if masks is not None:
                found += 1
                masks[0] &= ~(1 << slot)
                masks[1] &= ~(1 << slot)
        return found

    def clear(self, slot: int) -> int:
        changed = 0
        for masks in self.slots.values():
            changed += bool((masks[0] | masks[1]) >> slot & 1)
            masks[0] &= ~(1 << slot)
            masks[1] &= ~(1 << slot)
        return changed

    def routed(self, slot: int, hashes: Iterable[int]) -> None:
        for h in hashes:
            self.slots.setdefault(table_key(h), [0, 0])[1] |= 1 << slot

    def expire_routed(self) -> int:
        expired = 0
        for masks in self.slots.values():
            if masks[1]:
                masks[1] = 0
                expired += 1
        return expired

    def compact(self) -> None:
        self.slots = {k: m for k, m in self.slots.items() if m[0] | m[1]}

    def masks(self, block_hash: int) -> tuple[int, int] | None:
        m = self.slots.get(table_key(block_hash))
        return None if m is None else (m[0], m[1])

    def depths(self, hashes: list[int], candidates: int, events_only: bool = False) -> dict[int, int]:
        """The linear walk: leading hashes whose event (| routed) mask has the server's bit."""
        out = {}
        for s in range(candidates.bit_length()):
            if candidates >> s & 1:
                d = 0
                while d < len(hashes):
                    m = self.slots.get(table_key(hashes[d]))
                    if m is None or not ((m[0] if events_only else m[0] | m[1]) >> s & 1):
                        break
                    d += 1
                out[s] = d
        return out

    def jump_depths(self, hashes: list[int], candidates: int, jump: int, events_only: bool = False) -> dict[int, int]:
        """pick_kv's jump walk, each server on its own (native/picks.c, `jump_walk`): probe the
        last block of every window of `jump` blocks; at the first probe g a server lacks, bisect
        [window start, g] for a block it lacks whose predecessor it holds (or the window start).
        Equal to `depths` when the server's set is prefix-closed along `hashes`."""
        out = {}
        for s in range(candidates.bit_length()):
            if not candidates >> s & 1:
                continue

            def holds(j: int) -> bool:
                m = self.slots.get(table_key(hashes[j]))
                return m is not None and bool((m[0] if events_only else m[0] | m[1]) >> s & 1)  # noqa: B023 (called only in this iteration)

            lo, n, depth = 0, len(hashes), len(hashes)
            while lo < n:
                g = min(lo + jump, n) - 1
                if not holds(g):
                    hi = g
                    while lo < hi:
                        mid = (lo + hi) // 2
                        if holds(mid):
                            lo = mid + 1
                        else:
                            hi = mid
                    depth = lo
                    break
                lo = g + 1
            out[s] = depth
        return out

    def census(self) -> tuple[int, int, int]:
        """(used, live, dead)"""
        live = sum(1 for m in self.slots.values() if m[0] | m[1])
        return len(self.slots), live, len(self.slots) - live
