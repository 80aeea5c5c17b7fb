"""The KV block index in shared memory: block hash -> servers, and conversation sessions.

Owns the index segments "/{prefix}-idx-{generation:x}" (create, map, remap, retire, unlink; on
2 MiB pages where the kernel allows it, `Segment.create(huge=True)`) and sequences the native
`Index` calls; every shared word is touched in `shmdisagg._native` only
(native/index.c, layout and concurrency in native/README.md). It never writes the control
segment's server table or another worker's row.

Roles:
- The coordinator (`BlockIndex.create`) is the single writer of every slot's event mask (from KV
  events), of the index metrics and of the publication of the current generation. It sweeps
  (routed-bit TTL, session LRU), resizes/compacts into a new generation, and unlinks retired
  generations after a grace period.
- Workers (`BlockIndex.attach`) map the published generation read-write: a pick inserts the
  blocks it routes and sets their routed bits, so every worker's next decision counts them.
  A worker notices a new generation on its next pick (one acquire load in C) and remaps.

Full-index policy: a generation accepts keys up to `max_load` x capacity (0.6 by default, where
linear probing still has short probes); past that, inserts are refused and counted
(`index_full_drops`), never stored, and the walk simply stops matching at the missing block. The
coordinator's `maintain()` grows the table (next power of two >= live / 0.35) when more than
`grow_at` of it is used, up to `max_capacity`, and compacts (drops keys whose masks are both 0)
at the same size once dead keys are worth reclaiming. At `max_capacity` with little to reclaim the
refusals continue until the TTL sweep and LRU eviction turn entries dead and a compaction runs.
"""

from __future__ import annotations

import math
import os
import threading
import time
from array import array
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import posix_ipc

from shmdisagg._native import Index
from shmdisagg.shm.layout import LAG_BUCKETS, index_name, index_size
from shmdisagg.shm.segment import RetryExhausted, Segment, SegmentNotReady, ShmError, segment_names
from shmdisagg.shm.table import ControlTable

__all__ = ["BlockIndex", "IndexSettings", "IndexStats", "lag_bucket_edges", "pack_hashes"]

_REMAP_ATTEMPTS = 16


@dataclass(frozen=True)
class IndexSettings:
    """Sizing and expiry of the block index (coordinator side).

    Attributes:
        capacity: slots of the first generation (power of two), and the smallest a compaction
            shrinks to.
        max_capacity: the bound on slots (power of two); memory per generation is 32 B a slot
            beside a table of 64 server slots, 16 + 16 x max_servers / 64 B beside a wider one
            (`layout.index_slot_bytes`: 80 B for 256), and a resize briefly holds two generations.
        max_load: keys a generation accepts, as a fraction of its slots; later inserts are
            refused and counted.
        grow_at: `maintain()` rebuilds a generation once more than this fraction of it is used.
        routed_ttl_s: routed bits (set by workers at routing time) older than this are cleared
            by the sweep unless a KV event confirmed the block (Dynamo's approximate mode: 120 s).
        max_sessions: explicit conversation sessions kept; the least recently used go first.
        max_implicit: implicit-conversation prefix entries (one per block hash) kept, LRU.
        grace_s: a retired generation is unlinked this long after its successor is published.
    """

    capacity: int = 1 << 16
    max_capacity: int = 1 << 22
    max_load: float = 0.6
    grow_at: float = 0.45
    routed_ttl_s: float = 120.0
    max_sessions: int = 100_000
    max_implicit: int = 1_000_000
    grace_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("capacity", "max_capacity"):
            index_size(getattr(self, name))  # ValueError unless a power of two in range
        if self.capacity > self.max_capacity:
            raise ValueError("capacity must not exceed max_capacity")
        if not 0.0 < self.max_load < 1.0 or not 0.0 < self.grow_at <= self.max_load:
            raise ValueError("need 0 < grow_at <= max_load < 1")
        if self.routed_ttl_s < 0 or self.grace_s < 0 or self.max_sessions < 0 or self.max_implicit < 0:
            raise ValueError("routed_ttl_s, grace_s, max_sessions and max_implicit must be >= 0")


@dataclass(frozen=True)
class IndexStats:
    """A snapshot of the index metrics (control segment) and the mapped generation.

    Counters (`events_applied`, `blocks_applied`, `index_full_drops`, ...) only grow: derive
    per-second rates by differencing two snapshots. `live`/`dead`/`sessions` are from the last
    sweep. `lag_hist[b]` counts event-to-visibility lags in `lag_bucket_edges(b)` ns: log-linear,
    4 sub-buckets per octave (each at most 25 % wide), so an edge is within 25 % of the lag.
    """

    generation: int
    capacity: int
    used: int
    load_factor: float
    max_probe: int
    live: int
    dead: int
    sessions: int
    implicit_entries: int
    events_applied: int
    blocks_applied: int
    blocks_stored: int
    blocks_removed: int
    servers_cleared: int
    events_dropped: int
    index_full_drops: int
    race_reruns: int
    routed_expired: int
    evicted: int
    sweeps: int
    resizes: int
    lag_samples: int
    lag_sum_ns: int
    lag_hist: tuple[int, ...] = field(repr=False)

    def lag_quantile_ns(self, q: float) -> int:
        """Upper bound (ns, the exclusive upper edge of its bucket) of the q-quantile of the
        event-to-visibility lag; 0 if no lag was recorded."""
        total = sum(self.lag_hist)
        if total == 0:
            return 0
        rank, seen = q * total, 0
        for b, n in enumerate(self.lag_hist):
            seen += n
            if n and seen >= rank:
                return lag_bucket_edges(b)[1]
        return lag_bucket_edges(LAG_BUCKETS - 1)[1]


def lag_bucket_edges(b: int) -> tuple[int, int]:
    """[lower, upper) edges in ns of bucket `b` of the lag histogram (`IndexStats.lag_hist`).

    Buckets 0..3 hold a lag of exactly b ns; bucket 4m + s (m >= 2, s in 0..3) holds the lags whose
    highest set bit is m and the two bits below it are s: [(4 + s) << (m - 2), (5 + s) << (m - 2)).
    Buckets 4..7 are never counted and have the empty range [4, 4). ValueError outside 0..255.
    """
    if not 0 <= b < LAG_BUCKETS:
        raise ValueError(f"lag bucket {b} outside 0..{LAG_BUCKETS - 1}")
    if b < 8:
        return (b, b + 1) if b < 4 else (4, 4)
    shift = (b >> 2) - 2
    return (4 + (b & 3)) << shift, (5 + (b & 3)) << shift


def pack_hashes(hashes: bytes | Sequence[int]) -> bytes:
    """Block hashes as packed little-endian u64 (the native calls' format); bytes pass through."""
    if isinstance(hashes, bytes):
        return hashes
    return array("Q", hashes).tobytes()


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


class BlockIndex:
    """One process's handle on the current block index generation.

    Attributes:
        table: the control table it routes with (its Region holds the rows and publication).
        owner: True in the coordinator that created it.
        settings: sizing and expiry (coordinator).
    State (per process): `_segment`/`_ix` the mapped generation; `_retired` (coordinator)
    generations waiting out their grace period as (unlink_at_monotonic, segment, index);
    `_replay` the events applied while a resize copies (None when not resizing), guarded with
    `_lock` by every coordinator write.
    """

    def __init__(self, table: ControlTable, segment: Segment, ix: Index, owner: bool, settings: IndexSettings) -> None:
        self.table = table
        self.owner = owner
        self.settings = settings
        self._segment = segment
        self._ix = ix
        self._retired: list[tuple[float, Segment, Index]] = []
        self._replay: list[tuple[str, tuple[Any, ...]]] | None = None
        self._lock = threading.Lock()

    # -- lifecycle ---------------------------------------------------------------------------

    @classmethod
    def create(cls, table: ControlTable, settings: IndexSettings | None = None) -> BlockIndex:
        """Coordinator: build generation (published + 1), publish it in the control table.

        Raises ShmError if `table` is not the coordinator's, SegmentFull if /dev/shm has no room.
        """
        settings = settings or IndexSettings()
        region = table._writer()
        generation = table.index_publication()[0] + 1
        segment, ix = _build(table, generation, settings.capacity, settings.max_load)
        try:
            ix.publish()
            region.publish_index(generation, ix.capacity, segment.size, segment.name.encode())
        except BaseException:
            _discard(segment, ix)
            raise
        return cls(table, segment, ix, True, settings)

    @classmethod
    def adopt(cls, table: ControlTable, settings: IndexSettings | None = None) -> BlockIndex | None:
        """A restarted coordinator (owning `table` by `ControlTable.adopt`): become the writer of
        the generation the dead one published, so the blocks and conversation sessions it holds
        go on serving; generations it had retired or was building are unlinked. None if no
        generation is published (create one)."""
        mapped = _map_published(table)
        if mapped is None:
            return None
        segment, ix = mapped
        for name in segment_names(index_name(table.prefix, 0)[:-1]):
            if name != segment.name:
                with suppress(posix_ipc.ExistentialError):
                    posix_ipc.unlink_shared_memory(name)
        return cls(table, segment, ix, True, settings or IndexSettings())

    @classmethod
    def attach(cls, table: ControlTable, *, timeout: float = 2.0) -> BlockIndex:
        """Worker: map the generation the control table publishes (waiting up to `timeout` s
        for the coordinator to publish one). Raises SegmentNotReady on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            mapped = _map_published(table)
            if mapped is not None:
                return cls(table, mapped[0], mapped[1], False, IndexSettings())
            if time.monotonic() >= deadline:
                raise SegmentNotReady(f"{table.name}: no block index published within {timeout} s")
            time.sleep(0.001)  # the coordinator is between creating the table and publishing

    def close(self) -> None:
        """Release and unmap every generation this process holds (the coordinator also drops the
        segments' locks). Does not unlink: the coordinator's `unlink()` or
        `ControlTable.unlink()` does. Idempotent."""
        for _, segment, ix in self._retired:
            _discard(segment, ix, unlink=False)
        self._retired.clear()
        _discard(self._segment, self._ix, unlink=False)

    def unlink(self) -> None:
        """Coordinator: unlink every generation's name (mappings stay valid until closed)."""
        for _, segment, _ in self._retired:
            segment.unlink()
        self._segment.unlink()

    def __enter__(self) -> BlockIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def generation(self) -> int:
        return int(self._ix.generation)

    @property
    def capacity(self) -> int:
        return int(self._ix.capacity)

    @property
    def name(self) -> str:
        return self._segment.name

    @property
    def huge_bytes(self) -> int:
        """Coordinator: bytes of the current generation its creation put on 2 MiB pages (0 where
        the kernel would not: `Segment.create(huge=True)`); workers: 0 (they map it 2 MiB-aligned,
        so its huge pages map whole either way)."""
        return self._segment.huge_bytes

    # -- coordinator: KV events --------------------------------------------------------------

    def _write(self, op: str, *args: Any) -> int:
        if not self.owner:
            raise ShmError(f"{self.name}: only the coordinator applies KV events")
        with self._lock:
            if self._replay is not None:
                self._replay.append((op, args))
            return int(getattr(self._ix, op)(*args))

    def apply_stored(self, slot: int, hashes: bytes | Sequence[int], event_ts_ns: int = 0) -> int:
        """Server `slot` now holds these blocks (a "stored" event); returns blocks marked.

        `event_ts_ns`: the executor's wall-clock time of the event (time.time_ns()), 0 if unknown;
        it feeds the lag histogram. Blocks that do not fit a full index are counted and skipped.
        """
        return self._write("apply_stored", slot, pack_hashes(hashes), event_ts_ns)

    def apply_removed(self, slot: int, hashes: bytes | Sequence[int]) -> int:
        """Server `slot` evicted these blocks: clears its event and routed bits; returns found."""
        return self._write("apply_removed", slot, pack_hashes(hashes))

    def apply_all_cleared(self, slot: int) -> int:
        """Server `slot` dropped its whole cache: its bit leaves every block (one C loop)."""
        return self._write("apply_all_cleared", slot)

    def clear_server(self, slot: int) -> int:
        """Server `slot` was removed, turned unhealthy or is being reused: its bit leaves every
        block and conversation session (sessions re-route). Returns slots changed."""
        return self._write("clear_server", slot)

    def count_dropped(self, n: int = 1) -> None:
        """Count KV events the ingest dropped (unknown server, malformed) in the metrics."""
        self.table._writer().count_index_dropped(n)

    # -- coordinator: maintenance ------------------------------------------------------------

    def sweep(self, now_ns: int | None = None) -> dict[str, int]:
        """Expire routed bits older than `routed_ttl_s`, evict sessions beyond the LRU bounds,
        and store the census (live, dead, sessions, ...) in the metrics. Releases the GIL on
        large tables, so it may run in a thread beside the event ingest."""
        if not self.owner:
            raise ShmError(f"{self.name}: only the coordinator sweeps the index")
        s = self.settings
        now = time.monotonic_ns() if now_ns is None else now_ns
        return self._ix.sweep(now, int(s.routed_ttl_s * 1e9), s.max_sessions, s.max_implicit)

    def resize_target(self, census: dict[str, int]) -> int | None:
        """The capacity `maintain()` would rebuild at given a sweep's census, or None."""
        s, cap = self.settings, self.capacity
        if census["used"] <= s.grow_at * cap and census["max_probe"] <= 64:
            return None
        want = min(max(_pow2_at_least(int(census["live"] / 0.35)), s.capacity), s.max_capacity)
        if want > cap:
            return want  # grow
        if census["dead"] > 0.1 * cap or census["max_probe"] > 64:
            return max(want, min(cap, s.max_capacity))  # compact in place
        return None  # at max_capacity with little to reclaim: inserts are refused at the limit

    def resize(self, capacity: int | None = None) -> int:
        """Build generation + 1 at `capacity` (default: what the live keys need) with every live
        key, publish it, and retire this one (unlinked after `grace_s`). Returns the new
        generation. Events applied meanwhile (from another thread) are replayed onto it."""
        if not self.owner:
            raise ShmError(f"{self.name}: only the coordinator resizes the index")
        s = self.settings
        if capacity is None:
            capacity = min(max(_pow2_at_least(int(self._ix.scan()["live"] / 0.35)), s.capacity), s.max_capacity)
        generation = self.generation + 1
        segment, ix = _build(self.table, generation, capacity, s.max_load)
        try:
            with self._lock:
                self._replay = []
            self._ix.copy_into(ix)  # the GIL is released on large tables
            with self._lock:
                for op, args in self._replay:
                    getattr(ix, op)(*args)
                self._replay = None
                ix.publish()
                self.table._writer().publish_index(generation, ix.capacity, segment.size, segment.name.encode())
                old_segment, old_ix = self._segment, self._ix
                self._segment, self._ix = segment, ix
        except BaseException:
            self._replay = None
            _discard(segment, ix)
            raise
        old_ix.retire()
        self._retired.append((time.monotonic() + s.grace_s, old_segment, old_ix))
        return generation

    def maintain(self, now_ns: int | None = None) -> dict[str, int]:
        """One maintenance round (coordinator, every second or so): sweep, resize or compact if
        the census calls for it, unlink generations past their grace. Returns the census."""
        census = self.sweep(now_ns)
        target = self.resize_target(census)
        if target is not None:
            self.resize(target)
        self.unlink_retired()
        return census

    def unlink_retired(self, now: float | None = None) -> int:
        """Unlink and unmap retired generations whose grace period is over; returns how many."""
        now = time.monotonic() if now is None else now
        due = [r for r in self._retired if r[0] <= now]
        self._retired = [r for r in self._retired if r[0] > now]
        for _, segment, ix in due:
            _discard(segment, ix)
        return len(due)

    def stats(self) -> IndexStats:
        """Metrics from the control segment plus the mapped generation's occupancy."""
        m = self.table.index_metrics()
        ix = self._ix
        return IndexStats(
            generation=int(m["generation"]),
            capacity=int(ix.capacity),
            used=int(ix.used),
            load_factor=ix.used / ix.capacity,
            max_probe=int(ix.max_probe),
            live=m["live"],
            dead=m["dead"],
            sessions=m["sessions"],
            implicit_entries=m["implicit_entries"],
            events_applied=m["events_applied"],
            blocks_applied=m["blocks_applied"],
            blocks_stored=m["blocks_stored"],
            blocks_removed=m["blocks_removed"],
            servers_cleared=m["servers_cleared"],
            events_dropped=m["events_dropped"],
            index_full_drops=m["index_full_drops"],
            race_reruns=m["race_reruns"],
            routed_expired=m["routed_expired"],
            evicted=m["evicted"],
            sweeps=m["sweeps"],
            resizes=m["resizes"],
            lag_samples=m["lag_samples"],
            lag_sum_ns=m["lag_sum_ns"],
            lag_hist=tuple(m["lag_hist"]),
        )

    # -- workers: picks (own row; RowLost if reclaimed) --------------------------------------

    def refresh(self, row: int | None = None) -> bool:
        """Remap if the coordinator published a new generation (a worker's idle timer calls
        this; picks do it by themselves). Returns True if it remapped."""
        if self.owner or self.table.index_publication()[0] == self.generation:
            return False
        self._remap(row)
        return True

    def _remap(self, row: int | None) -> None:
        for _ in range(_REMAP_ATTEMPTS):
            mapped = _map_published(self.table)
            if mapped is None:
                continue
            _discard(self._segment, self._ix, unlink=False)
            self._segment, self._ix = mapped
            if row is not None:
                self._ix.observe(row)
            return
        raise ShmError(f"{self.table.name}: could not map the published block index")

    def _pick(self, op: str, row: int, *args: Any) -> Any:
        fn = getattr(self._ix, op)
        result = fn(row, *args)
        attempts = 0
        while result is None:  # the coordinator published a new generation: remap and retry
            attempts += 1
            if self.owner or attempts > _REMAP_ATTEMPTS:
                raise ShmError(f"{self.name}: index generation keeps changing")
            self._remap(row)
            result = getattr(self._ix, op)(row, *args)
        return result

    def pick_kv(
        self,
        row: int,
        role: int,
        exclude_slot: int,
        hashes: bytes,
        num_tokens: int,
        load_weight: float = 0.25,
        load_cap: float = math.inf,
        use_tokens: bool = False,
        track_routed: bool = True,
        max_batch_size: int = 0,
        pin_key: int = 0,
    ) -> tuple[int, int]:
        """KV-cache-aware pick, one native call: (slot, matched_blocks), or (-1, 0) if no server
        of `role` is eligible.

        Candidates are present, healthy, of `role`, not `exclude_slot`. Each one's depth is the
        number of leading `hashes` (packed u64, `hashing.block_hashes_bytes`) that a KV event or
        a routing marked on it, found by a jump walk (one probe per `_native.IX_JUMP` blocks,
        bisection where servers drop out: exact when each server's blocks are prefix-closed
        along the prompt; with holes see native/README.md); load is its active requests (or
        active tokens / its tokens_per_block with `use_tokens`) over every worker row. Among
        candidates with active / `max_batch_size` < load_cap (all, if none; `max_batch_size` 0:
        each server's own `/server_info` value, as published), the best depth -
        load_weight x load wins; ties rotate fleet-wide. With `track_routed`, the request's
        blocks past those the winner's KV events confirm are marked as routed to the winner
        (visible to every worker's next pick), after claiming the first
        block past the winner's match: a worker that lost that claim to a different server for
        the same prefix re-scores once, so racing workers converge on one server. The pick's load
        is added to `row`; release it with `ControlTable.release(row, slot, num_tokens)`.

        `pin_key` (a u64, 0: none) names a conversation (`routing.affinity`): the server its last
        pick chose wins, scores unread, while it is a candidate under the cap; whichever wins
        becomes its pin. Pins are session slots of the index, one per role, dropped with their
        server and least recently used first past `IndexSettings.max_sessions`.
        """
        return self._pick(  # type: ignore[no-any-return]  # _pick calls Index.pick_kv by name
            "pick_kv",
            row,
            role,
            exclude_slot,
            hashes,
            num_tokens,
            load_weight,
            load_cap,
            use_tokens,
            track_routed,
            max_batch_size,
            pin_key,
        )

    def pick_kv_claim(
        self,
        row: int,
        role: int,
        exclude_slot: int,
        hashes: bytes,
        num_tokens: int,
        load_weight: float = 0.25,
        load_cap: float = math.inf,
        use_tokens: bool = False,
        track_routed: bool = True,
        max_batch_size: int = 0,
        pin_key: int = 0,
        defer_min: int = 1,
    ) -> tuple[int, int, int]:
        """`pick_kv` up to its claim: (slot, matched_blocks, commit_from). The same decision,
        the claim of the first block past the winner's match included (so racing workers still
        converge), but when `defer_min` blocks or more are left to mark routed, their bits are
        left to `commit_routed(row, hashes, commit_from, slot)`, which a caller runs once the leg
        is on its way (`routing.kv_cache_aware`): for a new prompt they are ~80 % of the pick's
        time. commit_from is -1 when nothing is left to mark (no winner, no tracking, a full
        match, or fewer than `defer_min` blocks, marked at once). ValueError for defer_min < 1."""
        return self._pick(  # type: ignore[no-any-return]  # _pick calls Index.pick_kv_claim by name
            "pick_kv_claim",
            row,
            role,
            exclude_slot,
            hashes,
            num_tokens,
            load_weight,
            load_cap,
            use_tokens,
            track_routed,
            max_batch_size,
            pin_key,
            defer_min,
        )

    def commit_routed(self, row: int, hashes: bytes, start: int, slot: int) -> int:
        """Mark `hashes[start:]` (packed u64) routed to `slot`, stamped now, as `pick_kv` marks
        them after its claim; returns the blocks marked (0 when `slot` is no longer present: its
        bits would mislead the slot's next server). ValueError for a start past the hashes or a
        slot outside the table; RowLost if `row` is not ours."""
        return self._pick("commit_routed", row, hashes, start, slot)  # type: ignore[no-any-return]  # _pick calls Index.commit_routed by name

    def match(self, hashes: bytes, role: int = -1, jump: bool = False) -> list[tuple[int, int]]:
        """[(slot, depth)] of present, healthy servers (of `role`, if >= 0); read-only. Depths by
        the linear walk (leading blocks held), or with `jump` by pick_kv's jump walk (equal when
        every server's blocks are prefix-closed along `hashes`; native/README.md)."""
        result = self._ix.match(hashes, role, jump)
        if result is None:
            self._remap(None)
            result = self._ix.match(hashes, role, jump)
        return result or []

    def conv_pick_explicit(self, row: int, role: int, exclude_slot: int, conv_key: int, num_tokens: int) -> int:
        """Conversation-sticky pick by conversation key (`hashing.conversation_key`), the same
        server from every worker: the first decision wins (CAS); a session whose server is no
        longer a candidate moves to the candidate with the fewest active tokens; new sessions go
        there too. Refreshes the session's LRU stamp. -1 if no candidate."""
        return self._pick("conv_pick_explicit", row, role, exclude_slot, conv_key, num_tokens)  # type: ignore[no-any-return]  # _pick calls Index.conv_pick_explicit by name

    def conv_pick_implicit(
        self, row: int, role: int, exclude_slot: int, hashes: bytes, num_tokens: int, match_threshold: float = 0.75
    ) -> tuple[int, int]:
        """Conversation pick by prefix when there is no id: (slot, depth). The candidate routed
        the deepest prefix of `hashes` before wins if depth / len(hashes) >= match_threshold,
        else the one with the fewest active tokens; the hashes are then recorded for it."""
        return self._pick("conv_pick_implicit", row, role, exclude_slot, hashes, num_tokens, match_threshold)  # type: ignore[no-any-return]  # _pick calls Index.conv_pick_implicit by name

    def lookup(self, block_hash: int) -> tuple[int, int, int] | None:
        """(event_mask, routed_mask, routed_ts_ns) of one block hash, or None (diagnostics)."""
        return self._ix.lookup(block_hash)


def _build(table: ControlTable, generation: int, capacity: int, max_load: float) -> tuple[Segment, Index]:
    """Create, lock, size and initialise generation `generation` (state BUILDING)."""
    size = index_size(capacity, table.max_servers)
    segment = Segment.create(index_name(table.prefix, generation), size, huge=True)
    ix = None
    try:
        ix = Index(segment.mm, table._region)
        ix.init_index(generation, capacity.bit_length() - 1, int(capacity * max_load), time.time_ns())
    except BaseException:
        _discard(segment, ix)
        raise
    return segment, ix


def _discard(segment: Segment, ix: Index | None, unlink: bool = True) -> None:
    if ix is not None:
        ix.release()
    segment.close()
    if unlink:
        segment.unlink()


def server_blocks(table: ControlTable) -> dict[int, int] | None:
    """{slot: block entries a KV event confirmed on that server} for the slots holding any, read
    from the published generation mapped read-only for the call; None when no index is published
    (or it was replaced mid-call). A scan of the whole index (tens of ms at millions of slots):
    for tools such as `shmdisagg stats`, not for the request path. Works on a table attached
    read-only."""
    with _read_only_index(table) as ix:
        if ix is None:
            return None
        counts = ix.scan()["server_blocks"]
        return {slot: n for slot, n in enumerate(counts) if n}


def event_masks(table: ControlTable, hashes: Sequence[int]) -> dict[int, int] | None:
    """{block hash: bitmask of the servers (bit = slot) whose KV events say they hold it} for each
    of `hashes` (0: none, or not in the index), read from the published generation mapped
    read-only; None when no index is published (or it was replaced mid-call). Diagnostics and
    tests (what the index says a server holds, against what the server reported); works on a
    table attached read-only."""
    with _read_only_index(table) as ix:
        if ix is None:
            return None
        return {h: (found[0] if (found := ix.lookup(h)) else 0) for h in hashes}


@contextmanager
def _read_only_index(table: ControlTable) -> Iterator[Index | None]:
    """The published generation mapped read-only for the block (None if there is none)."""
    try:
        generation, _, nbytes, name = table.index_publication()
        if generation == 0:
            yield None
            return
        segment = Segment.attach(name, read_only=True, min_size=nbytes)
    except (RetryExhausted, FileNotFoundError, SegmentNotReady):
        yield None
        return
    ix = None
    try:
        ix = Index(segment.mm, table._region, False)
        yield ix if ix.check_index() and ix.generation == generation else None
    finally:
        _discard(segment, ix, unlink=False)


def _map_published(table: ControlTable) -> tuple[Segment, Index] | None:
    """Map the published generation read-write, or None if none is published yet or it was
    retired and unlinked between reading the publication and opening it (read it again)."""
    try:
        generation, _, nbytes, name = table.index_publication()
    except RetryExhausted:
        os.sched_yield()
        return None
    if generation == 0:
        return None
    try:
        segment = Segment.attach(name, min_size=nbytes, huge=True)
    except (FileNotFoundError, SegmentNotReady):
        return None
    ix = None
    try:
        ix = Index(segment.mm, table._region)
        if ix.check_index() and ix.generation == generation:
            return segment, ix
    except BaseException:
        _discard(segment, ix, unlink=False)
        raise
    _discard(segment, ix, unlink=False)
    return None
