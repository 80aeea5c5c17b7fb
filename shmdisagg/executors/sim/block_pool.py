"""The paged KV block pool: capacity accounting, prefix reuse by chained block hash, LRU eviction.

Only counts matter to the simulator, not which physical block holds what, so a block is either
- free (counted in `num_free`, no content),
- private to one request (counted in that request's `Allocation.private`), or
- cached: it has a block hash (`shmdisagg.hashing`'s v1 key, chained on its parent) and lives in
  `hash2block`, shared by `refcount` requests. A cached block with refcount 0 is *evictable*: it
  sits in `lru` (oldest first) until a request reuses it or an allocation evicts it.

Invariant: num_blocks == num_free + len(hash2block) + sum of live allocations' `private`.

A request acquires its matched prefix (refs on cached blocks) plus fresh private blocks, turns
private blocks into cached ones with `store` as their KV becomes complete (emitting `stored`),
and gives everything back with `release`. Released chains enter the LRU deepest block first, so
a chain is evicted from its leaf towards its root, as TensorRT-LLM and vLLM do. Each allocation
that evicts emits one `removed` event listing the evicted hashes. With reuse disabled, nothing is
ever cached: `match` returns 0 and `store` is a no-op.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NewType

from shmdisagg.executors.sim.kv_events import KvEventBuffer

BlockHash = NewType("BlockHash", int)


@dataclass
class CachedBlock:
    block_hash: BlockHash
    num_tokens: int
    refcount: int = 0


@dataclass(eq=False)
class Allocation:
    """What one request holds: refs on cached blocks (`held`, chain order) and private blocks."""

    held: list[BlockHash] = field(default_factory=list)
    private: int = 0
    released: bool = False


class BlockPool:
    def __init__(
        self, num_blocks: int, tokens_per_block: int, reuse: bool = True, events: KvEventBuffer | None = None
    ) -> None:
        if num_blocks < 1 or tokens_per_block < 1:
            raise ValueError("num_blocks and tokens_per_block must be positive")
        self.num_blocks = num_blocks
        self.tokens_per_block = tokens_per_block
        self.reuse = reuse
        self.events = events
        # per-pool state
        self.num_free = num_blocks
        self.hash2block: dict[BlockHash, CachedBlock] = {}
        self.lru: OrderedDict[BlockHash, None] = OrderedDict()
        self.num_evicted = 0
        if events is not None:
            events.created(num_blocks)

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_cached(self) -> int:
        return len(self.hash2block)

    @property
    def num_evictable(self) -> int:
        return len(self.lru)

    @property
    def num_available(self) -> int:
        """Blocks an allocation could get now: free plus evictable."""
        return self.num_free + len(self.lru)

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of the chain `hashes` are cached."""
        if not self.reuse:
            return 0
        n = 0
        table = self.hash2block
        for h in hashes:
            if h not in table:
                break
            n += 1
        return n

    # -- acquire / store / release ----------------------------------------------------------
    def acquire(self, shared: Sequence[int], private: int) -> Allocation | None:
        """Ref the cached blocks `shared` (a matched prefix) and take `private` fresh blocks,
        evicting LRU blocks as needed. None, with nothing changed, if there is not enough room."""
        reclaimed_by_refs = sum(1 for h in shared if h in self.lru)
        if private > self.num_free + len(self.lru) - reclaimed_by_refs:
            return None
        for h in shared:
            block = self.hash2block[BlockHash(h)]
            if block.refcount == 0:
                del self.lru[block.block_hash]
            block.refcount += 1
        self._take_free(private)
        return Allocation(held=[BlockHash(h) for h in shared], private=private)

    def store(self, alloc: Allocation, parent: int | None, blocks: Sequence[tuple[int, Sequence[int]]]) -> int:
        """Make blocks of `alloc` reusable. `blocks` are (hash, tokens) in chain order after
        `parent` (None for the root). A block already cached by another request is shared
        instead and the private block goes back to the free pool. Stops early if `alloc` has no
        private block left for a new one. Returns how many blocks it stored or shared."""
        if not self.reuse:
            return 0
        run: list[tuple[int, Sequence[int]]] = []
        run_parent = parent
        done = 0
        prev = parent
        for h, tokens in blocks:
            bh = BlockHash(h)
            block = self.hash2block.get(bh)
            if block is not None:
                self._emit_stored(run_parent, run)
                run = []
                if block.refcount == 0:
                    del self.lru[bh]
                block.refcount += 1
                if alloc.private > 0:
                    alloc.private -= 1
                    self.num_free += 1
            else:
                if alloc.private == 0:
                    break
                alloc.private -= 1
                self.hash2block[bh] = CachedBlock(bh, len(tokens), refcount=1)
                if not run:
                    run_parent = prev
                run.append((h, tokens))
            alloc.held.append(bh)
            done += 1
            prev = h
        self._emit_stored(run_parent, run)
        return done

    def release(self, alloc: Allocation) -> None:
        """Give back everything `alloc` holds; its cached blocks become evictable at refcount 0."""
        if alloc.released:
            return
        alloc.released = True
        for h in reversed(alloc.held):
            block = self.hash2block.get(h)
            if block is None:  # pragma: no cover - refs pin blocks, so a held hash is never evicted
                continue
            block.refcount -= 1
            if block.refcount == 0:
                self.lru[h] = None
        alloc.held = []
        self.num_free += alloc.private
        alloc.private = 0

    def clear(self) -> int:
        """Drop every evictable block (POST /sim/clear_cache); emits `all_cleared` when nothing
        is referenced any more, else a `removed` for the dropped blocks. Returns how many."""
        dropped = list(self.lru)
        for h in dropped:
            del self.hash2block[h]
        self.lru.clear()
        self.num_free += len(dropped)
        if self.events is not None:
            if not self.hash2block:
                self.events.all_cleared()
            else:
                self.events.removed(dropped)
        return len(dropped)

    def check_invariants(self, allocations: Sequence[Allocation] = ()) -> None:
        """Raise AssertionError if the accounting is off (tests only)."""
        private = sum(a.private for a in allocations if not a.released)
        if self.num_free + len(self.hash2block) + private != self.num_blocks:
            raise AssertionError(
                f"block accounting: free {self.num_free} + cached {len(self.hash2block)} + private {private} "
                f"!= {self.num_blocks}"
            )
        zero = {h for h, b in self.hash2block.items() if b.refcount == 0}
        if zero != set(self.lru):
            raise AssertionError("LRU does not match the unreferenced cached blocks")

    # -- internals ---------------------------------------------------------------------------
    def _take_free(self, n: int) -> None:
        evicted: list[int] = []
        while self.num_free < n:
            h, _ = self.lru.popitem(last=False)
            del self.hash2block[h]
            self.num_free += 1
            evicted.append(h)
        self.num_free -= n
        if evicted:
            self.num_evicted += len(evicted)
            if self.events is not None:
                self.events.removed(evicted)

    def _emit_stored(self, parent: int | None, run: list[tuple[int, Sequence[int]]]) -> None:
        if run and self.events is not None:
            self.events.stored(parent, run)
